"""Per-key lookups (engines that ask for their blocks one at a time, as vLLM's connector does):
each key's :class:`~tierkv.movement.lookup.KeyState`, pins for the request, and the cost model's
decision on the request's run of lower-tier blocks, weighed as one."""

from __future__ import annotations

import time

from tierkv.blocks.admission import Request, Want
from tierkv.blocks.pool import SlotState
from tierkv.movement.costmodel import RestoreRun
from tierkv.movement.lookup import _ABSENT, _MAYBE, _TIER, KeyState, Resolver, Work

__all__ = ["KeyLookups"]


class KeyLookups:
    """Per-key lookups over a :class:`~tierkv.movement.lookup.Resolver`'s view of the store (call
    under the store's lock)."""

    def __init__(self, resolver: Resolver) -> None:
        self.resolver = resolver

    def states(self, group: int, keys: list[bytes], req: Request) -> list[KeyState]:
        """Per key: its :class:`KeyState`; HIT and PENDING blocks are pinned for ``req``, and the
        promotions and probes the answer counts on are started."""
        pool = self.resolver.pools[group]
        work = Work()
        now = time.monotonic()
        out: list[KeyState] = []
        promos: list[Want] = []
        promo_pos: list[int] = []
        admission = self.resolver.admission
        weigh = self.resolver.cost.active and group in self.resolver.full_groups
        block_bytes = self.resolver.layout.groups[group].block_bytes
        for i, k in enumerate(keys):
            s = pool.index.get(k)
            if s is not None:
                if pool.state[s] is SlotState.READY:
                    out.append(KeyState.READY)
                else:
                    out.append(KeyState.PROMOTING if k in self.resolver.promoting else KeyState.STORING)
                admission.pin(req, group, k, s)
                continue
            st = self.resolver.locate(group, k, now, work)
            if _TIER <= st < _MAYBE:
                verdict = self._weigh_run(req, group, k, st - _TIER, block_bytes, now) if weigh else True
                if verdict is None:
                    out.append(KeyState.QUEUED)  # its run is being counted: asked again later
                    continue
                if verdict is False:
                    out.append(KeyState.MISS)  # recomputing it is faster
                    continue
                if verdict is not True:  # the run was just decided: its earlier blocks too
                    for ek, et in verdict:
                        if ek not in pool.index:
                            promos.append((ek, et))
                            promo_pos.append(-1)
                out.append(KeyState.PROMOTING)
                promos.append((k, st - _TIER))
                promo_pos.append(i)
            else:
                out.append(KeyState.MISS if st == _ABSENT else KeyState.PROBING)
        if promos:
            room = max(0, pool.num_slots - admission.pinned_in(req, group))
            for i in promo_pos[room:]:
                if i >= 0:
                    out[i] = KeyState.MISS
            if room:
                started = admission.admit(req, {group: promos[:room]})
                if started is None:
                    late = KeyState.MISS if admission.mode == "naive" else KeyState.QUEUED
                    for i in promo_pos[:room]:
                        if i >= 0:
                            out[i] = late
                else:
                    work.promotions += started
        self.resolver.promoter.start(work.promotions, work.probes)
        return out

    def _weigh_run(self, req: Request, group: int, key: bytes, tier: int, block_bytes: int,
                   now: float) -> bool | list[tuple[bytes, int]] | None:
        """The cost model's answer for a block on lower tier ``tier`` of the request's run of such
        blocks (:class:`~tierkv.movement.costmodel.RestoreRun`): False: recompute it; True: load it; None:
        not decided yet (the run is counted on); a list: just decided to load the run, these are
        its blocks asked before this one."""
        cost = self.resolver.cost
        run = req.runs.get(group)
        if run is None:
            run = req.runs[group] = RestoreRun()
        gw = self.resolver.gateways[tier]
        rate = gw.planning_rate(now)
        if run.verdict is not None:
            worth = run.verdict and cost.worth_loading(block_bytes, rate)
            if worth and run.started is not None and key not in run.keys:
                # promoted with the run: its wait ends once this block is READY too
                run.keys[key] = tier
                run.last = key
                run.read_s += block_bytes / max(rate, 1.0)
            return worth
        again = key in run.keys  # the engine's scan of the request restarted: the run is complete
        if not again:
            run.keys[key] = tier
        n = len(run.keys)
        fixed = max(cost.fixed_s(t) for t in set(run.keys.values()))
        verdict = cost.run_verdict(n, block_bytes, rate, fixed, again)
        if verdict is None:
            return None
        run.verdict = verdict
        if not verdict:
            return False
        run.started, run.tier, run.last = now, tier, next(reversed(run.keys))
        run.read_s = n * block_bytes / max(rate, 1.0)
        return [(k, t) for k, t in run.keys.items() if k != key]

    def restored(self, req: Request, group: int, key: bytes) -> None:
        """``key`` was answered READY for ``req``: when it ends the wait of the request's run, the
        wait beyond the run's read time is its tier's fixed restore cost."""
        run = req.runs.get(group)
        if run is not None and run.started is not None and key == run.last:
            self.resolver.cost.observe_fixed(run.tier, time.monotonic() - run.started - run.read_s)
            run.started = None
