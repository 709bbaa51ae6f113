"""bench/peers.py's results: rows from the rounds, the text tables, the markdown tables, the plot.

Every figure shown is in ``results`` (the JSON's rows); the tables and the plot only read them, so
the JSON, the table and the PNG of one run always agree. Ratios are taken within a round and then
their median (a system's round against the baseline's round of the same size), never as a ratio of
medians.
"""

from __future__ import annotations

import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["MB", "build_results", "markdown", "plot", "print_table", "run_stamp", "size_label"]

MB = 1e6
PHASES = (("store", None, "store_s"), ("load", "warm", "warm_s"), ("load", "cold", "cold_s"))


def size_label(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K"


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run_stamp(repo: Path) -> dict[str, str]:
    """The code a run measured: ``commit`` (``git describe``-style: the hash, ``-dirty`` when the
    work tree has changes) and ``branch``; "unknown" outside a git checkout."""
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    return {"commit": commit, "branch": git("rev-parse", "--abbrev-ref", "HEAD") or "unknown"}


def _secs(r: Any, attr: str) -> float | None:
    """A phase's seconds, or None where the system has no such phase (the device has no warm load)."""
    v = float(getattr(r, attr))
    return v if v > 0 else None


def _paired(s: list[Any], base: list[Any], attr: str, with_sync: bool = False) -> float | None:
    """Median over rounds of (system's seconds / base's seconds) = base MB/s / system MB/s."""
    if not s or len(s) != len(base):
        return None
    out = []
    for r, b in zip(s, base, strict=True):
        rs, bs = _secs(r, attr), _secs(b, attr)
        if rs is None or bs is None:
            return None
        if with_sync:
            rs, bs = rs + r.sync_s, bs + b.sync_s
        out.append(rs / bs)
    return median(out)


def build_results(names: list[str], sizes: list[int], samples: dict[tuple[str, int], list[Any]],
                  status: dict[str, str], n_bytes: dict[int, int], *, tierkv: str, tierkv_api: str,
                  device: str) -> list[dict[str, Any]]:
    """One row per (system, block size, phase): MB/s (median of rounds) and the paired ratios:
    ``ratio_vs_tierkv`` (tierkv's MB/s / the system's), ``ratio_vs_tierkv_api`` (the same for the
    tierkv-api row), ``fraction_of_device`` (the system's MB/s / fio's; store and cold only) and,
    for stores, ``fraction_of_device_with_sync`` (counting the ``sync`` after the store)."""
    rows: list[dict[str, Any]] = []
    for size in sizes:
        base = samples.get((tierkv, size), [])
        api = samples.get((tierkv_api, size), [])
        dev = samples.get((device, size), [])
        for name in names:
            s = samples.get((name, size), [])
            for direction, cache, attr in PHASES:
                row: dict[str, Any] = {"system": name, "block_bytes": size, "direction": direction,
                                       "cache": cache, "mb_s": None, "ratio_vs_tierkv": None,
                                       "ratio_vs_tierkv_api": None, "fraction_of_device": None,
                                       "status": status[name], "raw_bytes": n_bytes.get(size)}
                secs = [_secs(r, attr) for r in s]
                if s and all(x is not None for x in secs):
                    mbs = [n_bytes[size] / MB / x for x in secs if x is not None]
                    row["mb_s"] = median(mbs)
                    row["rounds_mb_s"] = mbs
                    row["verified"] = all(r.bad == 0 and r.missing == 0 for r in s)
                    if name != tierkv:
                        row["ratio_vs_tierkv"] = _paired(s, base, attr)
                    if name != tierkv_api:
                        row["ratio_vs_tierkv_api"] = _paired(s, api, attr)
                    if name != device:
                        f = _paired(dev, s, attr)
                        row["fraction_of_device"] = f
                    if direction == "store":
                        row["mb_s_with_sync"] = median([n_bytes[size] / MB / (r.store_s + r.sync_s)
                                                        for r in s])
                        if name != device:
                            row["fraction_of_device_with_sync"] = _paired(dev, s, attr, with_sync=True)
                        row["disk_bytes"] = int(median([r.disk_bytes for r in s]) or 0)
                        row["file_bytes"] = int(median([r.file_bytes for r in s]) or 0)
                        row["files"] = s[-1].files
                    if cache == "cold":
                        row["page_cache_dropped"] = all(r.cold_dropped for r in s)
                    if cache == "warm" and s[0].warm_reader_reads is not None:
                        row["reader_reads"] = [r.warm_reader_reads for r in s]  # per round
                elif s:
                    row["verified"] = all(r.bad == 0 and r.missing == 0 for r in s)
                rows.append(row)
    return rows


def fmt(x: float | None, spec: str = "8.0f") -> str:
    width = int(spec.split(".")[0])
    return f"{x:{spec}}" if x is not None else f"{'-':>{width}}"


def _by(results: list[dict[str, Any]]) -> dict[tuple[str, int, str, str | None], dict[str, Any]]:
    return {(r["system"], r["block_bytes"], r["direction"], r["cache"]): r for r in results}


def print_table(results: list[dict[str, Any]], sizes: list[int], names: list[str],
                systems: list[dict[str, Any]], guards: dict[str, dict[str, Any]], out: Any,
                stamp: str = "") -> None:
    """The device table (MB/s and fractions of fio's), the ratio table, then the guarantees."""
    by = _by(results)
    ok = [n for n in names if next(s for s in systems if s["system"] == n)["status"] == "ok"]
    hdr = (f"{'system':<17}{'block':>6}{'store':>8}{'of dev':>8}{'+sync':>8}{'of dev':>8}{'warm':>8}"
           f"{'cold':>8}{'of dev':>8}")
    print(f"\nMB/s, median of rounds; 'of dev' = the system's MB/s / the device's (fio, same round,"
          f" same directory; median of per-round fractions){'; ' + stamp if stamp else ''}", file=out)
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for size in sizes:
        for name in ok:
            s, w, c = (by[(name, size, "store", None)], by[(name, size, "load", "warm")],
                       by[(name, size, "load", "cold")])
            print(f"{name:<17}{size_label(size):>6}{fmt(s['mb_s'])}{fmt(s['fraction_of_device'], '8.2f')}"
                  f"{fmt(s.get('mb_s_with_sync'))}{fmt(s.get('fraction_of_device_with_sync'), '8.2f')}"
                  f"{fmt(w['mb_s'])}{fmt(c['mb_s'])}{fmt(c['fraction_of_device'], '8.2f')}", file=out)
    hdr = (f"{'system':<17}{'block':>6}{'disk MB':>9}{'raw/disk':>9}{'x store':>9}{'x warm':>8}{'x cold':>8}"
           f"{'xa store':>10}{'xa warm':>9}{'xa cold':>9}")
    print("\nx = tierkv MB/s / system MB/s, xa = the same for tierkv-api (medians of per-round ratios;"
          " above 1: tierkv faster)", file=out)
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for size in sizes:
        for name in ok:
            s, w, c = (by[(name, size, "store", None)], by[(name, size, "load", "warm")],
                       by[(name, size, "load", "cold")])
            disk = s.get("disk_bytes")
            raw = disk and s.get("raw_bytes", 0) / disk
            print(f"{name:<17}{size_label(size):>6}{fmt(disk / MB if disk else None, '9.0f')}"
                  f"{fmt(raw or None, '9.3f')}{fmt(s['ratio_vs_tierkv'], '9.2f')}"
                  f"{fmt(w['ratio_vs_tierkv'], '8.2f')}{fmt(c['ratio_vs_tierkv'], '8.2f')}"
                  f"{fmt(s['ratio_vs_tierkv_api'], '10.2f')}{fmt(w['ratio_vs_tierkv_api'], '9.2f')}"
                  f"{fmt(c['ratio_vs_tierkv_api'], '9.2f')}", file=out)
    for s in systems:
        if s["status"] != "ok":
            extra = f"; install: {s['install']}" if s.get("install") else ""
            print(f"{s['system']:<17}{s['status']}: {s['detail']}{extra}", file=out)
    if guards:
        hdr = f"{'system':<17}{'wrong bytes (1 flipped byte)':<32}{'capacity bound':<42}restart reuse"
        print("\nguarantees (1 MiB blocks)", file=out)
        print(hdr, file=out)
        print("-" * (len(hdr) + 12), file=out)
        for name, g in guards.items():
            if "error" in g:
                print(f"{name:<17}error: {g['error']}", file=out)
                continue
            print(f"{name:<17}{g['wrong_bytes']:<32}{g['capacity']:<42}{g['restart']}", file=out)


def _cell(row: dict[str, Any], key: str = "mb_s", spec: str = ",.0f") -> str:
    v = row.get(key)
    return "-" if v is None else f"{v:{spec}}"


def markdown(results: list[dict[str, Any]], sizes: list[int], names: list[str], stamp: str) -> str:
    """The two tables of docs/performance-history.md's peers section, as markdown, from ``results``."""
    by = _by(results)
    ok = [n for n in names if by.get((n, sizes[0], "store", None), {}).get("mb_s") is not None]
    lines = [f"<!-- {stamp} -->", "",
             "| system | block | store MB/s | of device | +sync MB/s | of device | warm MB/s | cold MB/s"
             " | of device |", "|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        for n in ok:
            s, w, c = (by[(n, size, d, k)] for d, k, _ in PHASES)
            cells = [_cell(s), _cell(s, "fraction_of_device", ".2f"), _cell(s, "mb_s_with_sync"),
                     _cell(s, "fraction_of_device_with_sync", ".2f"), _cell(w), _cell(c),
                     _cell(c, "fraction_of_device", ".2f")]
            lines.append(f"| {n} | {size_label(size)} | " + " | ".join(cells) + " |")
    lines += ["", "| system | block | x store | x warm | x cold | xa store | xa warm | xa cold |",
              "|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        for n in ok:
            s, w, c = (by[(n, size, d, k)] for d, k, _ in PHASES)
            cells = [_cell(r, k, ".2f") for k in ("ratio_vs_tierkv", "ratio_vs_tierkv_api")
                     for r in (s, w, c)]
            lines.append(f"| {n} | {size_label(size)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(path: str, results: list[dict[str, Any]], sizes: list[int], names: list[str], stamp: str,
         device: str) -> str:
    """Bars of every system's MB/s (the table's medians) per phase and block size; the device's
    MB/s (fio) as a black line over each size's bars; ``stamp`` (date, commit, command) on top."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"--plot: matplotlib is not installed (pip install 'tierkv-cache[plot]'); no plot written"
                f" to {path}")
    by = {(r["system"], r["block_bytes"], r["direction"], r["cache"]): r["mb_s"] for r in results}
    systems = [n for n in names if n != device]
    fig, axes = plt.subplots(1, len(PHASES), figsize=(5.5 * len(PHASES), 4.6), sharey=False)
    width = 0.8 / max(1, len(systems))
    for ax, (direction, cache, _) in zip(axes, PHASES, strict=True):
        for j, name in enumerate(systems):
            ys = [by.get((name, s, direction, cache)) or 0.0 for s in sizes]
            ax.bar([i + j * width for i in range(len(sizes))], ys, width, label=name)
        for i, s in enumerate(sizes):
            dev = by.get((device, s, direction, cache))
            if dev:
                ax.hlines(dev, i - width / 2, i + width * (len(systems) - 0.5), colors="black",
                          linewidth=2, label="device (fio)" if i == 0 else None)
        ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(sizes))],
                      [size_label(s) for s in sizes])
        ax.set_title(f"{direction}{' ' + cache if cache else ''} (MB/s, median of rounds)", fontsize=10)
        ax.set_ylabel("MB/s")
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(stamp, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"
