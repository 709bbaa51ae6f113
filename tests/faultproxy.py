"""A TCP proxy on 127.0.0.1 in front of an S3 server that misbehaves on request: the first
``failures`` requests are answered ``503 SlowDown``, dropped (the connection closed once the request
is read) or never answered; later ones pass through. It runs its own event loop in a thread, so
both S3 clients (s3fs on the test's loop, obstore on its Rust threads) meet it the same way."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Literal

__all__ = ["FaultProxy"]

Mode = Literal["slowdown", "drop", "hang"]

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    """``with FaultProxy(upstream_port) as proxy: proxy.fail("slowdown", 2)``; ``proxy.endpoint_url``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode: Mode = "slowdown"
        self.failures = 0
        self.requests = 0
        self.failed = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail(self, mode: Mode, failures: int) -> None:
        """The next ``failures`` requests misbehave as ``mode`` says."""
        self.mode, self.failures = mode, failures

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        self.requests += 1
        if self.failures > 0:
            self.failures -= 1
            self.failed += 1
            if self.mode == "hang":
                with contextlib.suppress(Exception):
                    await reader.read()  # until the client gives up and closes
            elif self.mode == "slowdown":
                writer.write(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                             b"%d\r\nConnection: close\r\n\r\n%s" % (len(_SLOWDOWN), _SLOWDOWN))
                with contextlib.suppress(Exception):
                    await writer.drain()
            writer.close()
            return
        # one request per connection (the server closes it after answering), so that every
        # request of the client comes here first
        lines = [ln for ln in head[:-4].split(b"\r\n") if not ln.lower().startswith(b"connection:")]
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        up_writer.write(b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n")

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        writer.close()
