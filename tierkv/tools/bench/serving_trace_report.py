"""The output of ``tierkv bench serving --trace``: per-system figures, the breakdown against prefix
caching alone, and the table (:mod:`tierkv.tools.bench.serving_trace`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierkv.tools.bench.trace_serving import percentile

__all__ = ["TRACE_KEYS", "breakdown", "ms", "render", "summarize_system"]

#: the engine-time counters (:class:`~tierkv.tools.bench.serving_engine.Trace`) averaged per request
TRACE_KEYS = ("lookup_s", "worker_load_s", "worker_store_s", "schedule_s", "execute_s", "idle_steps", "steps")


def summarize_system(name: str, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The reported figures of one system from its samples."""
    ttfts = [s["ttft_s"] for s in samples]
    p50, p90 = percentile(ttfts, 0.5), percentile(ttfts, 0.9)
    return {"system": name, "requests": len(samples),
            "prompt_tokens": sum(s["prompt_tokens"] for s in samples),
            "cached_tokens": sum(s["cached_tokens"] for s in samples),
            "ttft_p50_s": None if p50 is None else round(p50, 6),
            "ttft_p90_s": None if p90 is None else round(p90, 6)}


def breakdown(systems: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system: the means of where the engine spent each request's time and, against ``prefix``
    request by request, the medians of the TTFT ratio and difference, over the requests it served
    no more tokens of than prefix caching alone (what tierkv costs when it restores nothing), and
    over those it served more of (its restores)."""
    base = systems.get("prefix")
    out: dict[str, dict[str, Any]] = {}
    for name, res in systems.items():
        samples = res["samples"]
        row: dict[str, Any] = {f"mean_{k}": round(statistics.fmean(s["trace"].get(k, 0.0) for s in samples),
                                                  6) for k in TRACE_KEYS}
        row["mean_queue_s"] = round(statistics.fmean(s["queue_s"] or 0.0 for s in samples), 6)
        if base is not None and name != "prefix":
            b = base["samples"]
            same = [i for i, s in enumerate(samples) if s["cached_tokens"] <= b[i]["cached_tokens"]]
            more = [i for i, s in enumerate(samples) if s["cached_tokens"] > b[i]["cached_tokens"]]
            for label, idx in (("no_restore", same), ("restored", more)):
                row[f"{label}_requests"] = len(idx)
                ratio = percentile([samples[i]["ttft_s"] / b[i]["ttft_s"] for i in idx], 0.5)
                diff = percentile([samples[i]["ttft_s"] - b[i]["ttft_s"] for i in idx], 0.5)
                row[f"{label}_ttft_ratio"] = None if ratio is None else round(ratio, 4)
                row[f"{label}_ttft_diff_s"] = None if diff is None else round(diff, 6)
        out[name] = row
    return out


def ms(x: float | None) -> str:
    """Seconds as milliseconds with one decimal ("-" for None)."""
    return "-" if x is None else f"{x * 1e3:.1f}"


def render(result: dict[str, Any], out: Any) -> None:
    """The table of systems, the ceiling, and what tierkv cost against prefix caching alone."""
    from rich.table import Table

    setup = result["setup"]
    ceiling = result["ceiling_tokens"]
    t = Table(title=(f"{setup['requests']} requests of {Path(setup['trace']).name}, "
                     f"{setup['ids_per_request']} ids x {setup['tokens_per_id']} tokens, {setup['model']} "
                     f"({setup['layers']} layers), arrivals back to back"))
    for col in ("system", "requests", "prompt tokens", "cached tokens", "of ceiling", "TTFT p50 ms",
                "TTFT p90 ms", "queued ms (mean)", "steps (mean)"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for r in result["results"]:
        b = result["breakdown"].get(r["system"], {})
        t.add_row(r["system"], f"{r['requests']:,}", f"{r['prompt_tokens']:,}", f"{r['cached_tokens']:,}",
                  f"{r['cached_tokens'] / ceiling:.0%}" if ceiling else "-", ms(r["ttft_p50_s"]),
                  ms(r["ttft_p90_s"]), ms(b.get("mean_queue_s")), f"{b.get('mean_steps', 0):.1f}")
    out.print(t)
    out.print(f"ceiling (an unbounded prefix cache): {ceiling:,} tokens", highlight=False)
    for name, b in result["breakdown"].items():
        if "no_restore_requests" not in b:
            continue
        parts = [f"{b[f'{label}_requests']} {what}: TTFT x{b[f'{label}_ttft_ratio']:.3f} "
                 f"({ms(b[f'{label}_ttft_diff_s'])} ms)"
                 for label, what in (("no_restore", "served no more"), ("restored", "served more"))
                 if b[f"{label}_requests"]]
        out.print(f"{name} against prefix, request by request (medians): {'; '.join(parts)}", highlight=False)
