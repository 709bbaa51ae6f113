"""The daemon's wire format: length-prefixed JSON messages with a hard size limit.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON holding one object. Block
bytes never travel in a frame: messages name keys (hashes as hex) and pool slots; the client copies
rows through the shared pool file itself. A frame longer than :data:`MAX_MESSAGE` is refused before
its body is read.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from tierkv.errors import InvalidArgument, TierUnavailable

__all__ = ["HEADER_BYTES", "MAX_MESSAGE", "MAX_REQUEST_ID", "VERSION", "body_length", "decode", "dial",
           "encode", "recv_message", "send_message"]

#: the protocol's version; a hello with another is refused
VERSION = 1
#: the longest request id a message may carry
MAX_REQUEST_ID = 256
#: the largest frame body either side accepts (1 MiB: about 14,000 keys of 32-byte hashes)
MAX_MESSAGE = 1 << 20
_HEADER = struct.Struct(">I")
#: bytes of a frame's length prefix
HEADER_BYTES = _HEADER.size


def encode(msg: dict[str, Any]) -> bytes:
    """One frame holding ``msg``; :class:`InvalidArgument` when it is over the size limit."""
    body = json.dumps(msg, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_MESSAGE:
        raise InvalidArgument(f"a daemon message of {len(body)} bytes is over the {MAX_MESSAGE}-byte limit:"
                              " ask for fewer blocks per call")
    return _HEADER.pack(len(body)) + body


def body_length(header: bytes) -> int:
    """The body length a frame's 4-byte header announces; :class:`InvalidArgument` past the limit."""
    (n,) = _HEADER.unpack(header)
    if n > MAX_MESSAGE:
        raise InvalidArgument(f"message of {n} bytes is over the {MAX_MESSAGE}-byte limit")
    return int(n)


def decode(body: bytes) -> dict[str, Any]:
    """The JSON object of a frame's body; :class:`InvalidArgument` when it is not one."""
    try:
        msg = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise InvalidArgument("message is not valid JSON") from None
    if not isinstance(msg, dict):
        raise InvalidArgument("message is not a JSON object")
    return msg


def send_message(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Send one frame on a blocking socket (its timeout applies)."""
    sock.sendall(encode(msg))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise TierUnavailable("the tierkv daemon closed the connection")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    """Read one frame from a blocking socket; :class:`TierUnavailable` when the peer went away."""
    n = body_length(_recv_exactly(sock, _HEADER.size))
    return decode(_recv_exactly(sock, n))



def dial(path: str, hello: dict[str, Any], timeout_s: float) -> tuple[socket.socket, dict[str, Any]]:
    """Connect to the daemon at ``path`` and say ``hello``: the connection and the daemon's answer
    (an error answer included). Raises :class:`OSError` or :class:`TierUnavailable`, the socket
    closed, when the daemon cannot be reached."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        send_message(sock, hello)
        return sock, recv_message(sock)
    except BaseException:
        sock.close()
        raise
