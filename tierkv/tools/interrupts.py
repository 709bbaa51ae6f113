"""Whether an exception is Ctrl-C: the test the command and the benchmarks it runs share."""

from __future__ import annotations

__all__ = ["interrupted"]


def interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` is Ctrl-C, or an error raised while Ctrl-C unwound (a cleanup it cut short:
    ``shutil.rmtree`` interrupted half-way raises ``EBADF`` from its own ``finally``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__context__
    return False
