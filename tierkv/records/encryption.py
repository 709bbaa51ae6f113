"""Encryption at rest: a tier's keys, read from key files, and AES-256-GCM through ``cryptography``.

A key file holds one 256-bit key as 64 hex characters (surrounding white space is ignored) and
nothing else, at most :data:`KEY_FILE_MAX_BYTES` in all; it must not be open to group or others. A
key given where its file's path belongs (:func:`looks_like_key`) is refused without being shown.
A :class:`KeyRing` holds the tier's current key (it encrypts every record written) and older keys
still accepted for reading (rotation). Records name their key by its **key id**, the first 8 bytes
of SHA-256 over a fixed label and the key: enough to pick the key, nothing about the key itself.

The key bytes live only in the ring's AES contexts and a private attribute: no ``repr``, ``str``,
error message or log line shows them (they show key ids). The record format (where the nonce, key
id and tag go, what is authenticated) is :mod:`tierkv.records.format`'s; this module only seals and opens.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Sequence
from typing import Any, Final

from tierkv.errors import ConfigError, CorruptRecord, install_hint

__all__ = ["KEY_FILE_MAX_BYTES", "KEY_ID_LEN", "KEY_LEN", "KEY_NOT_A_PATH", "NONCE_LEN", "TAG_LEN", "KeyRing",
           "key_id", "load_key_file", "looks_like_key"]

#: AES-256: 32 key bytes, 64 hex characters in a key file
KEY_LEN: Final = 32
KEY_ID_LEN: Final = 8
#: GCM's 96-bit nonce, fresh and random per record
NONCE_LEN: Final = 12
TAG_LEN: Final = 16
_KEY_ID_LABEL: Final = b"tierkv key id v1\x00"
_HEX: Final = frozenset(b"0123456789abcdefABCDEF")
#: a key file is 64 hex characters and some white space: a larger file is not a key file
KEY_FILE_MAX_BYTES: Final = 4096
#: longer than any path the system takes (Linux's PATH_MAX): a value this long is not a path
_PATH_MAX: Final = 4096
#: what an error says of a key (or another secret) given where a key file's path belongs
KEY_NOT_A_PATH: Final = ("the value given looks like a key, not a path to a key file (it is not shown): "
                         "put the key in a file (chmod 600) and give that file's path")


def looks_like_key(value: str) -> bool:
    """Whether ``value``, given as a key file's path, is rather a secret: hex of 128 bits or more
    (a key pasted in), or longer than any path. Errors never show such a value."""
    text = value.strip()
    return len(value) > _PATH_MAX or (len(text) >= 32 and set(text.encode("utf-8", "replace")) <= _HEX)


def key_id(key: bytes) -> bytes:
    """The id a record names ``key`` by: the first 8 bytes of SHA-256 of a label and the key."""
    return hashlib.sha256(_KEY_ID_LABEL + key).digest()[:KEY_ID_LEN]


def load_key_file(path: str) -> bytes:
    """The 32-byte key in ``path`` (64 hex characters).

    Raises :class:`~tierkv.errors.ConfigError` naming the file (never its contents) when it is
    missing, not a regular file, open to group or others, larger than :data:`KEY_FILE_MAX_BYTES`
    or does not hold exactly one key; and, without showing it, when ``path`` looks like a key.
    """
    if looks_like_key(path):
        raise ConfigError(f"encryption key file: {KEY_NOT_A_PATH}")
    if not path.strip():
        raise ConfigError("encryption key file: the path is empty")
    where = f"encryption key file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot open it ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where}: not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"{where} is open to group or others (mode {oct(st.st_mode & 0o777)}): a key "
                              f"others can read protects nothing; chmod 600 (or 400) it")
        raw = b""
        while len(raw) <= KEY_FILE_MAX_BYTES and (more := os.read(fd, KEY_FILE_MAX_BYTES + 1 - len(raw))):
            raw += more
    finally:
        os.close(fd)
    if len(raw) > KEY_FILE_MAX_BYTES:
        raise ConfigError(f"{where} must hold one 256-bit key as 64 hex characters and nothing else "
                          f"(it is larger than {KEY_FILE_MAX_BYTES} bytes)")
    text = raw.strip()
    if len(text) != 2 * KEY_LEN or not set(text) <= _HEX:
        other = "" if set(text) <= _HEX else ", not all hex"
        raise ConfigError(f"{where} must hold one 256-bit key as 64 hex characters and nothing else "
                          f"(it holds {len(text)} non-blank bytes{other}); "
                          "make one with: python -c 'import secrets; print(secrets.token_hex(32))'")
    return bytes.fromhex(text.decode("ascii"))


def _aesgcm() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ConfigError(f"encryption at rest needs the cryptography package: {install_hint('encrypt')}"
                          ) from None
    return AESGCM


class KeyRing:
    """The keys of one tier: ``current`` encrypts, it and ``old`` decrypt (looked up by key id).

    ``accept_plain``: whether unencrypted records are served (written before encryption was on).
    Safe to share between threads: each thread gets its own AES contexts.
    """

    def __init__(self, current: bytes, old: Sequence[bytes] = (), accept_plain: bool = True) -> None:
        cls = _aesgcm()
        for k in (current, *old):
            if len(k) != KEY_LEN:
                raise ConfigError(f"an encryption key is {KEY_LEN} bytes, got {len(k)}")
        self._cls = cls
        self._keys: dict[bytes, bytes] = {}
        for k in (current, *old):
            self._keys.setdefault(key_id(k), k)
        #: the id records written now carry
        self.current_id = key_id(current)
        self.accept_plain = accept_plain
        self._tls = threading.local()

    @classmethod
    def from_files(cls, key_file: str, old_key_files: Sequence[str] = (), accept_plain: bool = True
                   ) -> KeyRing:
        """A ring from key files (see :func:`load_key_file`)."""
        return cls(load_key_file(key_file), [load_key_file(p) for p in old_key_files], accept_plain)

    @property
    def ids(self) -> frozenset[bytes]:
        """Ids of every key this ring decrypts with."""
        return frozenset(self._keys)

    def holds(self, kid: bytes) -> bool:
        """Whether a record with key id ``kid`` can be decrypted here."""
        return kid in self._keys

    def _aead(self, kid: bytes) -> Any:
        cache: dict[bytes, Any] | None = getattr(self._tls, "aeads", None)
        if cache is None:
            cache = self._tls.aeads = {}
        aead = cache.get(kid)
        if aead is None:
            aead = cache[kid] = self._cls(self._keys[kid])
        return aead

    def seal_into(self, nonce: bytes, plain: Any, aad: bytes, out: Any) -> None:
        """Encrypt ``plain`` with the current key into ``out`` (``len(plain) + TAG_LEN`` bytes:
        ciphertext, then the tag), authenticating ``aad`` too."""
        aead = self._aead(self.current_id)
        into = getattr(aead, "encrypt_into", None)
        if into is not None:
            into(nonce, plain, aad, out)
        else:  # cryptography before encrypt_into: one more copy
            memoryview(out)[:] = aead.encrypt(nonce, bytes(plain), aad)

    def open_into(self, kid: bytes, nonce: bytes, sealed: Any, aad: Any, out: Any) -> None:
        """Decrypt ``sealed`` (ciphertext, then the tag) with key ``kid`` into ``out``
        (``len(sealed) - TAG_LEN`` bytes). Raises :class:`~tierkv.errors.CorruptRecord`
        (``auth``) when the tag does not match: another key, another place, a changed byte.
        ``out`` then holds bytes that must not be used."""
        from cryptography.exceptions import InvalidTag

        aead = self._aead(kid)
        try:
            into = getattr(aead, "decrypt_into", None)
            if into is not None:
                into(nonce, sealed, aad, out)
            else:
                memoryview(out).cast("B")[:] = aead.decrypt(nonce, bytes(sealed), bytes(aad))
        except InvalidTag:
            raise CorruptRecord("auth", "the record does not authenticate: written by another key, "
                                        "for another place, or changed") from None

    def __repr__(self) -> str:
        old = len(self._keys) - 1
        return f"KeyRing(key id {self.current_id.hex()}, {old} old key(s), accept_plain={self.accept_plain})"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a KeyRing is not pickled: its keys stay in this process")
