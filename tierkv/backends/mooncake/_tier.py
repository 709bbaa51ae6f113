"""``mooncake``: blocks in a Mooncake Store cluster, the memory pool its nodes contribute.

A ``mooncake_master`` places each object in the memory segment of one of the processes that set
up a client against it (``segment_bytes``; 0 for a client that contributes none) and evicts,
cluster-wide, when the pool is full. Each block is one object holding a tierkv record, named as
the block's record is on the other tiers (:func:`~tierkv.backends.namespace.record_path` under
the root ``tierkv``), so processes of one namespace share blocks and other namespaces never see
them.

What the tier adds to Mooncake: every read is checked (a damaged or truncated object is a counted
miss and is removed); an object evicted by the master, or held by a node that has gone, is a miss,
never an error; presence is one batched query. Blocking Mooncake calls run on the tier's worker
threads; a master that does not answer makes calls fail (Mooncake's status codes), and the store's
health machinery (:mod:`tierkv.movement.availability`) takes the tier for down, then attaches it again once
the master answers. Mooncake's client reconnects by itself and mounts its segment again on a master
that restarted (empty: a master keeps its objects in memory), on its next heartbeat; until then the
master answers writes "no room", which the tier, having seen the master go, takes for "not
answering" (the writes wait in the store's retry queue) rather than a full pool, and its health
check passes once the master takes a write again.

Mooncake answers a write of a name that exists with success, complete or not (a put another
process left unfinished, killed in the middle of it): each written name is asked for afterwards, and
one not complete is written over (upsert) or counted as a failed store, never as stored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import anyio
import torch

from tierkv.backends.base import Capabilities, RowLanded, Tier, TierConfig, TierContext
from tierkv.backends.mooncake._client import (
    ABSENT,
    DOWN_CODES,
    INCOMPLETE,
    NO_AVAILABLE_HANDLE,
    NOT_MOUNTED,
    MooncakeClient,
    Verdicts,
    Writes,
    probe_master,
)
from tierkv.backends.mooncake._config import MooncakeTierConfig
from tierkv.backends.namespace import record_path
from tierkv.backends.threads import DaemonPool, Jobs
from tierkv.errors import BackendError, TierUnavailable
from tierkv.records.read import none_heads
from tierkv.tensors import as_bytes

__all__ = ["MooncakeTier", "MooncakeTierConfig", "object_name"]

log = logging.getLogger("tierkv.mooncake")
T = TypeVar("T")
#: the root of every object name the tier writes
ROOT = "tierkv"
#: the longest wait for the master's port before Mooncake's own (slow) setup is tried
PROBE_S = 2.0


def object_name(fingerprint: str, key: bytes) -> str:
    """The Mooncake object name of ``key``'s record in the namespace ``fingerprint``."""
    return record_path(ROOT, fingerprint, key)


def _close_quietly(client: MooncakeClient) -> None:
    try:
        client.close()
    except Exception as exc:
        log.warning("closing a mooncake client set up after its open was given up: %s", exc)


class MooncakeTier(Tier):
    """Records in a Mooncake Store cluster (see the module's documentation)."""

    kind = "mooncake"
    capabilities = Capabilities(persistent=False, fast_contains=False, listable=False, deletable=True,
                                bounded=False)
    config_model = MooncakeTierConfig

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, MooncakeTierConfig)
        self.cfg = config
        self._client: MooncakeClient | None = None
        self._pool: DaemonPool | None = None
        self._jobs = Jobs(self.count)

    def describe(self) -> str:
        """The master's endpoint."""
        return f"mooncake {self.cfg.master}"

    @property
    def client(self) -> MooncakeClient:
        """The client, once open; :class:`TierUnavailable` before (or after close)."""
        if self._client is None:
            raise TierUnavailable(f"{self.describe()} is not open")
        return self._client

    def name(self, key: bytes) -> str:
        """The object name of ``key``."""
        return object_name(self.context.fingerprint, key)

    async def _run(self, fn: Callable[[], T], buffers: bool) -> T:
        """``fn`` on a worker thread. ``buffers``: it uses the caller's rows, so a cancelled wait
        still waits for it to end (until :meth:`abandon`); otherwise it is bounded by
        ``request_timeout_s`` and left behind past it (raising :class:`TierUnavailable`)."""
        if self._pool is None:
            raise TierUnavailable(f"{self.describe()} is not open")
        if buffers:
            (res,) = await self._jobs.run_all(self._pool, [fn], buffers=True)
            return res
        try:
            with anyio.fail_after(self.cfg.request_timeout_s):
                (res,) = await self._jobs.run_all(self._pool, [fn], buffers=False)
        except TimeoutError:
            raise TierUnavailable(f"{self.describe()}: no answer within request_timeout_s="
                                  f"{self.cfg.request_timeout_s:g}") from None
        return res

    # ---- life cycle -------------------------------------------------------------------------------
    async def open(self) -> None:
        """Connect to the master and mount this process's segment.

        A master that does not accept connections raises :class:`TierUnavailable` at once (the
        store then works without the tier and attaches it when the master answers). Setup runs
        on a thread of its own: an open cut short by ``open_timeout_s`` leaves it to end, and a
        client it set up after all is closed again.
        """
        await self._drop()
        await anyio.to_thread.run_sync(probe_master, self.cfg.master, min(PROBE_S, self.cfg.open_timeout_s))
        client = MooncakeClient(self.cfg)
        setup = DaemonPool(1, "tierkv-mooncake-setup")
        lock = threading.Lock()
        state = {"wanted": True, "ready": False}

        def run() -> None:
            try:
                client.setup()
            except BaseException:
                client.closed = True
                raise
            with lock:
                state["ready"] = True
                if state["wanted"]:
                    return
            _close_quietly(client)  # the open was cut short meanwhile: nobody will use this client

        try:
            await Jobs(self.count).run_all(setup, [run], buffers=False)
        except BaseException:
            with lock:
                state["wanted"] = False
                orphan = state["ready"]
            if orphan:  # set up just as the open was cut short
                threading.Thread(target=_close_quietly, args=(client,), name="tierkv-mooncake-close",
                                 daemon=True).start()
            raise
        finally:
            setup.shutdown(wait=False)
        self._client = client
        self._pool = DaemonPool(self.cfg.io_depth, "tierkv-mooncake")
        self._jobs = Jobs(self.count)

    async def check(self) -> None:
        """Ask the master whether a probe object exists, and, after it went away, whether it takes
        a write again: raises :class:`TierUnavailable` when it does not."""
        client = self.client
        why = await self._run(client.check, buffers=False)
        if why is not None:
            raise TierUnavailable(why)

    def abandon(self) -> None:
        """See :meth:`Tier.abandon`."""
        self._jobs.abandon()

    async def close(self) -> None:
        """Unmount this process's segment (its objects leave the cluster) and disconnect."""
        await self._drop()

    async def _drop(self) -> None:
        client, pool = self._client, self._pool
        self._client = self._pool = None
        if pool is not None:
            await self._jobs.shutdown([pool])
        if client is not None:
            closer = DaemonPool(1, "tierkv-mooncake-close")
            try:
                await Jobs(self.count).run_all(closer, [client.close], buffers=False)
            except Exception as exc:
                log.warning("closing %s: %s", self.describe(), exc)
            finally:
                closer.shutdown(wait=False)

    # ---- Tier API ---------------------------------------------------------------------------------
    async def put(self, group: int, keys: Sequence[bytes], blocks: torch.Tensor) -> list[bool]:
        """Write one record per block; per key whether the master holds it complete afterwards.

        A full pool whose objects are all leased (``-200``) is a counted ``False``
        (``pool_full``). A name another writer left unfinished is written over (``replaced``), or
        a counted ``False`` (``incomplete``). Raises :class:`TierUnavailable` when no key was
        written because the master does not answer, or because it came back without the
        segments (a restarted master): the store then takes the tier for down and queues the
        writes for when it takes writes again.
        """
        if not keys:
            return []
        client = self.client
        rows = as_bytes(blocks, len(keys), blocks.numel() * blocks.element_size() // len(keys))
        np_rows = rows.cpu().numpy()
        names = [self.name(k) for k in keys]
        fp = self.context.fingerprint
        try:
            w: Writes = await self._run(lambda: client.put(names, keys, np_rows, fp), buffers=True)
        except TierUnavailable:
            raise
        except Exception as exc:
            raise BackendError(f"storing records on {self.describe()} failed: {exc}") from None
        codes = w.codes
        ok = [c == 0 for c in codes]
        down = sum(1 for c in codes if c in DOWN_CODES or c == NOT_MOUNTED)
        unmounted = codes.count(NOT_MOUNTED)
        full = codes.count(NO_AVAILABLE_HANDLE)
        incomplete = codes.count(INCOMPLETE)
        if w.replaced:
            self.count("replaced", w.replaced)
        if down:
            self.count("unavailable_errors", down)
        if unmounted:
            self.count("not_mounted", unmounted)
        if full:
            self.count("pool_full", full)
        if incomplete:
            self.count("incomplete", incomplete)
        failed = len(keys) - sum(ok) - down - full - incomplete
        if failed:
            self.count("write_errors", failed)
        self.notify("stored", [k for k, good in zip(keys, ok, strict=True) if good])
        if down == len(keys):
            why = ("it answers again but no segment is mounted on it yet (status -200)" if unmounted
                   else f"the master does not answer (status {codes[0]})")
            raise TierUnavailable(f"writing records on {self.describe()}: {why}")
        if len(keys) - sum(ok):
            bad = next(c for c in codes if c != 0)
            why = "left unfinished by another writer" if bad == INCOMPLETE else f"status {bad}"
            log.warning("writing records: %d of %d on %s failed (%s)", len(keys) - sum(ok), len(keys),
                        self.describe(), why)
        return ok

    async def get(self, group: int, keys: Sequence[bytes], out: torch.Tensor,
                  landed: RowLanded | None = None) -> list[bool]:
        """Read and verify records straight into ``out``'s rows; a damaged or truncated object
        is a counted miss (``corrupt``, ``corrupt_<reason>``) and is removed; an object the master
        evicted or whose node has gone is a miss."""
        if not keys:
            return []
        client = self.client
        block = out.numel() * out.element_size() // len(keys)
        np_out = as_bytes(out, len(keys), block).numpy()
        fp = self.context.fingerprint
        head_parts = none_heads(keys, fp, block, 2)
        heads = [head_parts[len(k)][0] + k + head_parts[len(k)][1] for k in keys]
        names = [self.name(k) for k in keys]
        try:
            v: Verdicts = await self._run(lambda: client.get(names, keys, np_out, heads, fp), buffers=True)
        except TierUnavailable:
            raise
        except Exception as exc:
            raise BackendError(f"reading records on {self.describe()} failed: {exc}") from None
        if v.down == len(keys):
            raise TierUnavailable(f"{self.describe()}: the master does not answer")
        if v.down:
            self.count("unavailable_errors", v.down)
        if v.transfer_errors:
            self.count("transfer_errors", v.transfer_errors)
        found = []
        corrupt = []
        for k, f in zip(keys, v.found, strict=True):
            found.append(f is True)
            if isinstance(f, str):
                self.count("corrupt")
                self.count(f"corrupt_{f}")
                log.warning("corrupt record (%s) in %s: %s removed", f, self.describe(), k.hex())
                corrupt.append(k)
        if v.removed:
            self.count("corrupt_removed", v.removed)
        self.notify("removed", corrupt)
        return found

    async def contains(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Whether each object exists: one batched query (a later ``get`` still verifies it)."""
        if not keys:
            return []
        client = self.client
        names = [self.name(k) for k in keys]
        codes = await self._run(lambda: client.exist(names), buffers=False)
        if all(c < 0 for c in codes):
            raise TierUnavailable(f"{self.describe()}: presence query failed (status {codes[0]})")
        bad = sum(1 for c in codes if c < 0)
        if bad:
            self.count("probe_errors", bad)
        return [c == 1 for c in codes]

    async def delete(self, group: int, keys: Sequence[bytes]) -> None:
        """Remove objects (leases or not); keys not held are ignored."""
        if not keys:
            return
        client = self.client
        names = [self.name(k) for k in keys]
        codes = await self._run(lambda: client.remove(names), buffers=False)
        failed = [c for c in codes if c != 0 and c not in ABSENT]
        if failed and all(c in DOWN_CODES for c in failed):
            raise TierUnavailable(f"{self.describe()}: removing objects failed (status {failed[0]})")
        if failed:
            self.count("delete_errors", len(failed))
        self.notify("removed", list(keys))
