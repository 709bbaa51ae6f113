"""Fault-injecting tier wrappers: fail every N-th operation, slow down, cap the read bandwidth, or
damage stored records.

``FaultyTier`` wraps any tier and is registered as kind ``faulty``, so a store config can use it::

    {"kind": "faulty", "inner": {"kind": "fsspec", "url": "..."}, "fail_every": 3,
     "error": "ENOSPC", "ops": ["put"], "delay_s": 0.0, "max_read_bytes_per_s": null}
"""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence
from typing import Any, Literal

import anyio
import torch
from pydantic import Field, ValidationError, field_validator

from tierkv.backends.base import Capabilities, RowLanded, Tier, TierConfig, TierContext
from tierkv.backends.registry import get_backend
from tierkv.errors import TierKVError, format_validation_error

__all__ = ["FaultyTier", "FaultyTierConfig", "SlowDown", "make_error"]

Op = Literal["put", "get", "contains", "delete", "list_keys"]


class SlowDown(OSError):
    """What an S3 503 SlowDown looks like once s3fs has translated it."""

    def __init__(self) -> None:
        super().__init__(errno.EBUSY, "503 SlowDown: please reduce your request rate")


def make_error(name: str) -> OSError:
    """An exception by name: ``ENOSPC``, ``EIO``, ``EACCES`` or ``SlowDown``."""
    if name == "SlowDown":
        return SlowDown()
    code = getattr(errno, name)
    return OSError(code, f"injected {name}")


class FaultyTierConfig(TierConfig):
    """Settings of the ``faulty`` wrapper."""

    kind: str = "faulty"
    #: the wrapped tier's config (hidden from reprs: it may carry credentials)
    inner: dict[str, Any] = Field(repr=False)
    fail_every: int = Field(default=0, ge=0)
    error: Literal["ENOSPC", "EIO", "EACCES", "SlowDown"] = "EIO"
    ops: list[Op] = Field(default_factory=lambda: list[Op](["put", "get", "contains"]))
    delay_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    #: cap on the read bandwidth of all ``get`` calls together (a slow disk or a thin link): N bytes
    #: take at least N / this many seconds, whatever ``ops`` says
    max_read_bytes_per_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @field_validator("inner")
    @classmethod
    def _valid_inner(cls, v: dict[str, Any]) -> dict[str, Any]:
        """The wrapped tier's config is checked now, with its own model (errors name ``inner.*``)."""
        if "kind" not in v:
            raise ValueError("needs a 'kind'")
        try:
            get_backend(str(v["kind"])).config_model.model_validate(v)
        except ValidationError as exc:
            raise ValueError(format_validation_error(exc, "inner")) from None
        except TierKVError as exc:
            raise ValueError(str(exc)) from None
        return v


class FaultyTier(Tier):
    """Wraps a tier; calls of an op in ``ops`` are delayed by ``delay_s``, and every
    ``fail_every``-th of them raises ``error``."""

    kind = "faulty"
    config_model = FaultyTierConfig

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, FaultyTierConfig)
        self.cfg = config
        cls = get_backend(config.inner["kind"])
        self.inner: Tier = cls(cls.config_model.model_validate(config.inner), context)
        self.calls = 0
        self.injected = 0
        self._link_free_at = 0.0
        self.enabled = True

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """The wrapped tier's capabilities."""
        return self.inner.capabilities

    async def _maybe_fail(self, op: str) -> None:
        if op not in self.cfg.ops:
            return
        if self.cfg.delay_s:
            await anyio.sleep(self.cfg.delay_s)
        if not self.enabled or self.cfg.fail_every <= 0:
            return
        self.calls += 1
        if self.calls % self.cfg.fail_every == 0:
            self.injected += 1
            self.count("injected")
            raise make_error(self.cfg.error)

    async def open(self) -> None:
        """Open the wrapped tier."""
        await self.inner.open()

    async def close(self) -> None:
        """Close the wrapped tier."""
        await self.inner.close()

    async def background(self) -> None:
        """The wrapped tier's upkeep."""
        await self.inner.background()

    async def put(self, group: int, keys: Sequence[bytes], blocks: torch.Tensor) -> list[bool]:
        """Maybe fail, else delegate."""
        await self._maybe_fail("put")
        return await self.inner.put(group, keys, blocks)

    async def get(self, group: int, keys: Sequence[bytes], out: torch.Tensor,
                  landed: RowLanded | None = None) -> list[bool]:
        """Maybe fail, else delegate (no faster than ``max_read_bytes_per_s``)."""
        t0 = time.monotonic()
        await self._maybe_fail("get")
        found = await self.inner.get(group, keys, out)
        await self._throttle(t0, out.numel() * out.element_size() * sum(found) // max(1, len(keys)))
        return found

    async def put_rows(self, group: int, keys: Sequence[bytes], src: torch.Tensor,
                       rows: Sequence[int]) -> list[bool]:
        """Maybe fail, else delegate."""
        await self._maybe_fail("put")
        return await self.inner.put_rows(group, keys, src, rows)

    async def get_rows(self, group: int, keys: Sequence[bytes], dest: torch.Tensor, rows: Sequence[int],
                       landed: RowLanded | None = None) -> list[bool]:
        """Maybe fail, else delegate (no faster than ``max_read_bytes_per_s``)."""
        t0 = time.monotonic()
        await self._maybe_fail("get")
        found = await self.inner.get_rows(group, keys, dest, rows)
        await self._throttle(t0, dest.shape[1] * dest.element_size() * sum(found))
        return found

    async def _throttle(self, t0: float, nbytes: int) -> None:
        """Hold a read that began at ``t0`` until ``nbytes`` have crossed the link, when it has a rate."""
        if self.cfg.max_read_bytes_per_s:
            # one link shared by every call: concurrent reads queue behind each other
            self._link_free_at = max(self._link_free_at, t0) + nbytes / self.cfg.max_read_bytes_per_s
            await anyio.sleep(max(0.0, self._link_free_at - time.monotonic()))

    async def contains(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Maybe fail, else delegate."""
        await self._maybe_fail("contains")
        return await self.inner.contains(group, keys)

    def contains_nowait(self, group: int, keys: Sequence[bytes]) -> list[bool] | None:
        """Delegate."""
        return self.inner.contains_nowait(group, keys)

    async def delete(self, group: int, keys: Sequence[bytes]) -> None:
        """Maybe fail, else delegate."""
        await self._maybe_fail("delete")
        await self.inner.delete(group, keys)

    async def list_keys(self, group: int) -> list[bytes]:
        """Maybe fail, else delegate."""
        await self._maybe_fail("list_keys")
        return await self.inner.list_keys(group)

    def used_bytes(self) -> int | None:
        """The wrapped tier's usage."""
        return self.inner.used_bytes()

    def describe(self) -> str:
        """Wrapper and wrapped tier."""
        return f"faulty({self.inner.describe()})"

