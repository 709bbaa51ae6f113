"""What the commands share: argument types, the error printer, consoles and tables."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType
from typing import Any, TypeVar

from tierkv.tools.interrupts import interrupted

__all__ = ["Formatter", "console", "error", "kv_pairs", "nonneg_float", "positive_float", "positive_int",
           "print_table", "progress", "run_async", "warn", "interrupts_raise", "interrupted"]

T = TypeVar("T")

#: after the first Ctrl-C, a command that has not ended this much later exits 130 regardless
INTERRUPT_GRACE_S = 10.0


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown in every option's help (unless it says its own); descriptions keep their breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default == [] or any(
                action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def error(message: str) -> None:
    """One plain line on stderr: ``tierkv: error: ...`` (no markup is interpreted in it)."""
    print(f"tierkv: error: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """One plain line on stderr: ``tierkv: warning: ...``."""
    print(f"tierkv: warning: {message}", file=sys.stderr, flush=True)


def _number(kind: type, text: str, test: Any, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if not test(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an int > 0."""
    v: int = _number(int, text, lambda v: v > 0, "a positive integer")
    return v


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    v: float = _number(float, text, lambda v: v > 0, "a positive number")
    return v


def nonneg_float(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    v: float = _number(float, text, lambda v: v >= 0, "zero or more")
    return v


def kv_pairs(pairs: Sequence[str] | None, what: str = "storage option") -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a VALUE that parses as JSON is used as such (numbers, objects).

    A malformed pair is a usage error (exit 2)."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            error(f"{what} {pair!r} is not KEY=VALUE")
            raise SystemExit(2)
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def console(stderr: bool = False) -> Any:
    """A rich console that never interprets markup in the text it is given and, when the output is
    not a terminal, never cuts or wraps long lines (it writes them whole)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(file=stream, markup=False, highlight=False, emoji=False, soft_wrap=True,
                   width=None if tty else 1000, force_terminal=None if tty else False)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]],
                out: Any = None) -> None:
    """A table whose cells fold onto more lines when narrow, never cut (80 columns, a pipe)."""
    from rich.table import Table
    from rich.text import Text

    out = out if out is not None else console()
    table = Table(title=Text(title), title_justify="left", expand=False)
    for col in columns:
        table.add_column(Text(col), overflow="fold")
    for row in rows:
        table.add_row(*(Text(str(c)) for c in row))
    out.print(table)


def progress() -> Any:
    """A progress bar on stderr while a command runs; nothing at all when stderr is not a terminal."""
    from rich.progress import Progress

    return Progress(console=console(stderr=True), transient=True, disable=not sys.stderr.isatty())


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """``anyio.run(fn)``, with Ctrl-C certain to end the command.

    On the first Ctrl-C asyncio cancels the command's task, so stores close and temporary files go;
    a cancellation lost on the way (swallowed by some library's cleanup) would leave the command
    running, so if it has not ended :data:`INTERRUPT_GRACE_S` later it prints the same one line and
    exits 130 there and then. A second Ctrl-C ends it at once, as asyncio does.
    """
    import anyio

    async def main() -> T:
        _guard_interrupts()
        return await fn()

    interrupts_raise()  # so that asyncio installs its own handler (the command's may be in place)
    try:
        return anyio.run(main)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupts_raise() -> None:
    """From here on Ctrl-C raises ``KeyboardInterrupt`` (Python's default), for code that cleans up
    on it; until then the ``tierkv`` command exits at once (see :func:`tierkv.cli.main`)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _guard_interrupts() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    inner = signal.getsignal(signal.SIGINT)  # asyncio's: cancels the main task, then raises
    armed: list[threading.Timer] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if not armed:
            timer = threading.Timer(INTERRUPT_GRACE_S, _exit_interrupted)
            timer.daemon = True
            timer.start()
            armed.append(timer)
        if callable(inner):
            inner(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def _exit_interrupted() -> None:
    os.write(2, b"tierkv: error: interrupted\n")
    os._exit(130)
