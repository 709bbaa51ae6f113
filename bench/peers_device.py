"""The device row of bench/peers.py: fio (the OS package) in the harness's own directory.

Each run is one ``fio`` command with ``--output-format=json``: ``jobs`` threads (``--thread``), each
with its own file of ``size_per_job`` bytes, synchronous I/O (``psync``, queue depth 1 per thread:
each system's I/O threads make one blocking call at a time), blocks of ``bs`` bytes, ``O_DIRECT``
(``--direct=1``), no fsync (``--fsync=0 --end_fsync=0``: no system here fsyncs), files not
preallocated (``--fallocate=none``: the systems write new files). A read job with the same name
and directory reads the files the write job left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["FioResult", "fio", "fio_path", "fio_version"]

JOB = "peers"


def fio_path() -> str | None:
    """The fio binary: ``$TIERKV_FIO``, else ``fio`` on PATH, else /usr/bin/fio; None: not installed."""
    for cand in (os.environ.get("TIERKV_FIO"), shutil.which("fio"), "/usr/bin/fio"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def fio_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or out.stderr.strip()


@dataclass
class FioResult:
    """One fio run: bytes moved and fio's own rate (io_bytes / runtime, over every job)."""

    io_bytes: int
    bw_bytes: float
    runtime_ms: int
    command: list[str]


def fio(binary: str, directory: str, rw: str, bs: int, size_per_job: int, jobs: int, *,
        direct: bool = True, timeout: float = 900.0) -> FioResult:
    """Run one fio job group (``rw`` ``write`` or ``read``) in ``directory``; raises RuntimeError
    with fio's message when it fails."""
    cmd = [binary, f"--name={JOB}", f"--directory={directory}", f"--rw={rw}", f"--bs={bs}",
           f"--size={size_per_job}", f"--numjobs={jobs}", "--thread", "--ioengine=psync", "--iodepth=1",
           f"--direct={int(direct)}", "--fsync=0", "--end_fsync=0", "--fallocate=none",
           "--group_reporting", "--output-format=json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    text = proc.stdout
    if proc.returncode != 0 or "{" not in text:
        raise RuntimeError(f"fio {rw} failed ({proc.returncode}): {(proc.stderr or text).strip()[-300:]}")
    report = json.loads(text[text.index("{"):])
    job = report["jobs"][0][rw]
    if job["io_bytes"] <= 0 or job["runtime"] <= 0:
        raise RuntimeError(f"fio {rw} moved nothing: {json.dumps(job)[:300]}")
    return FioResult(int(job["io_bytes"]), float(job["bw_bytes"]), int(job["runtime"]), cmd)
