"""A reader process's own code (``python -m tierkv.backends.fsspec._readchild``): it maps the
shared regions it is given, then reads and checks the records each request names straight into
them and answers with the bytes it read per record (0: not read, the caller reads it itself).

Apart from :mod:`tierkv.backends.fsspec._readproc`, which starts it, so that the reading code it
imports never imports the module that starts it (no import circle).
"""

from __future__ import annotations

import mmap
import os
import sys
from multiprocessing.connection import Connection

from tierkv.backends.fsspec._driver import WouldBlock
from tierkv.backends.fsspec._localsource import LocalSource
from tierkv.backends.fsspec._readproc import Item
from tierkv.records import TRAILER_LEN, none_parts_match


def _serve(argv: list[str]) -> int:
    requests = Connection(int(argv[0]), writable=False)
    replies = Connection(int(argv[1]), readable=False)
    views: dict[int, memoryview] = {}
    for spec in argv[2:]:
        region, fd, size, populate = (int(x) for x in spec.split(":"))
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        views[region] = memoryview(mmap.mmap(fd, size, flags=flags))
        os.close(fd)

    def read_one(item: Item) -> int:
        region, offset, length, path, header = item
        row = views[region][offset:offset + length]
        head, tail = bytearray(len(header)), bytearray(TRAILER_LEN + 1)
        try:
            got = LocalSource(path, nowait=True).readinto([head, row, tail])
        except (OSError, WouldBlock):
            return 0
        return got if got is not None and none_parts_match(header, head, row, tail, got) else 0

    replies.send("ready")
    while True:
        try:
            batch = requests.recv()
        except EOFError:
            return 0
        replies.send([read_one(item) for item in batch])


def main() -> None:
    """A helper's life: serve batches until the request pipe closes; never a traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = _serve(sys.argv[1:])
    except BaseException:
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
