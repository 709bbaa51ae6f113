"""The ``tierkv`` command: ``demo``, ``simulate``, ``replay``, ``inspect``, ``verify``, ``bench``, ``serve``.

Every command prints errors as one plain line (``tierkv: error: ...``), never a Python traceback:
usage errors exit 2 (argparse), interrupts (Ctrl-C) 130, and each command documents its own exit
codes in its ``--help``. ``TIERKV_DEBUG=1`` shows the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from types import FrameType
from typing import Any


def _interrupted_while_starting(signum: int, frame: FrameType | None) -> None:
    os.write(2, b"tierkv: error: interrupted\n")
    os._exit(130)


def _catch_interrupts() -> Any:
    """Make Ctrl-C exit at once (one line, 130); the handler it replaces, or None off the main thread."""
    try:
        return signal.signal(signal.SIGINT, _interrupted_while_starting)
    except ValueError:  # not the main thread
        return None


# Ctrl-C while the commands' modules (torch among them) are still being imported: the same one
# line and exit status as later, never a traceback out of an import
_previous = _catch_interrupts()
try:
    from tierkv.cli import bench_cmds, replay_cmds, run_cmds, serve_cmds, tier_cmds
    from tierkv.cli.common import Formatter, error, interrupted
finally:
    if _previous is not None:
        signal.signal(signal.SIGINT, _previous)

__all__ = ["build_parser", "main"]

#: an unexpected error (a bug): reported in one line, like every other
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tierkv`` command."""
    p = argparse.ArgumentParser(
        prog="tierkv", formatter_class=Formatter,
        description="A tiered store for LLM KV caches: try it, inspect and verify persistent tiers, "
                    "measure your storage.",
        epilog="Exit codes: 0 success, 2 usage error or failure to run, 130 interrupted; see each "
               "command's --help for its own.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    run_cmds.add_demo(sub)
    run_cmds.add_simulate(sub)
    replay_cmds.add_replay(sub)
    tier_cmds.add_inspect(sub)
    tier_cmds.add_verify(sub)
    bench_cmds.add_bench(sub)
    serve_cmds.add_serve(sub)
    return p


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser that ``args`` went through last."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _chosen(action.choices[name], args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tierkv`` console script."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # until a command starts its work (run_async), Ctrl-C exits at once: a KeyboardInterrupt in the
    # middle of its lazy imports (torch's among them) could be swallowed by the module being imported
    previous = _catch_interrupts()
    try:
        if argv[:2] == ["bench", "serving"]:  # its own parser takes every option, --help included
            argv = [*argv[:2], "--", *argv[2:]]
        args, extra = parser.parse_known_args(argv)
        if extra:  # argparse would show the top level's usage; the command's own is the one to see
            _chosen(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
        rc: int = args.func(args)
        return rc
    except KeyboardInterrupt:
        error("interrupted")
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # argparse, or a command that exits on purpose
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except BrokenPipeError:  # `tierkv inspect ... | head`
        try:
            sys.stdout = open(os.devnull, "w")  # nothing more may reach the closed pipe
        except OSError:
            pass
        return 0
    except Exception as exc:
        from tierkv.errors import TierKVError

        if interrupted(exc):  # a cleanup that Ctrl-C interrupted raised on its way out
            error("interrupted")
            return EXIT_INTERRUPTED
        if isinstance(exc, TierKVError | OSError):
            error(str(exc) or type(exc).__name__)
            return 2
        if os.environ.get("TIERKV_DEBUG"):
            traceback.print_exc()
        error(f"unexpected {type(exc).__name__}: {str(exc)[:300]} (set TIERKV_DEBUG=1 for details; "
              "please report it)")
        return EXIT_INTERNAL
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
