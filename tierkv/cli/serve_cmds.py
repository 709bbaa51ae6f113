"""``tierkv serve``: the daemon that engines on one node share (docs/daemon.md)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from tierkv.cli.common import Formatter, run_async

__all__ = ["add_serve"]


def add_serve(sub: Any) -> None:
    """The ``serve`` command."""
    s = sub.add_parser("serve", formatter_class=Formatter,
                       help="run the daemon that engines on this node share",
                       description="Serve stores to engines on this node over a Unix socket: a CPU pool in "
                                   "shared memory and the lower tiers, shared by every store of the same "
                                   "namespace and layout (a store config with 'daemon: PATH' uses it).\n\n"
                                   "Runs until Ctrl-C or SIGTERM, then closes its stores (cascades "
                                   "finished within each tier's close_timeout_s) and removes the socket.\n\n"
                                   "Exit codes: 0 stopped, 2 bad config or socket path.")
    s.add_argument("--config", required=True, metavar="FILE",
                   help="JSON or YAML: cpu_bytes_to_use, tiers, namespaces, socket_mode... (docs/daemon.md)")
    s.add_argument("--socket", required=True, metavar="PATH", help="the Unix socket to listen on")
    s.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from tierkv.daemon.config import DaemonConfig

    config = DaemonConfig.from_file(args.config)
    path = os.path.abspath(args.socket)
    if len(os.fsencode(path)) > 107:
        raise _config_error(f"--socket {args.socket}: the path is too long for a Unix socket (107 bytes)")
    logging.basicConfig(level=logging.WARNING, format="tierkv: %(message)s", stream=sys.stderr)
    return run_async(lambda: _run(config, path))


def _config_error(message: str) -> Exception:
    from tierkv.errors import ConfigError

    return ConfigError(message)


async def _run(config: Any, path: str) -> int:
    import anyio

    from tierkv.daemon.server import Daemon, prepare_socket

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        sock = prepare_socket(path, config.socket_mode)
        ino = os.stat(path).st_ino
        try:
            async with anyio.create_task_group() as tg:
                daemon = Daemon(config, path)
                tg.start_soon(daemon.serve, sock,
                              lambda: print(f"tierkv: serving on {path}", file=sys.stderr, flush=True))
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break
        finally:
            try:
                if os.stat(path).st_ino == ino:  # still ours, not a newer daemon's
                    os.unlink(path)
            except OSError:
                pass
    return 0
