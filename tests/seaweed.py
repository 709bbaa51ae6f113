"""A real S3 server for tests: SeaweedFS (``weed server``) on 127.0.0.1, started once per test session.

Import the fixture into a test module: ``from seaweed import seaweed``. The server
(:class:`tierkv.testing.seaweed.SeaweedServer`) is a process-wide singleton (started on first use,
stopped at exit), so every module that imports the fixture shares one server however pytest scopes
fixtures; a test that left it killed or frozen gets it back running for the next test. Without a
``weed`` binary the fixture FAILS (CI installs it): a missing server must not turn the real-S3 tests
into silent skips.

Besides the server's own identity it accepts :data:`COMPAT_CREDENTIALS`, the ones the moto-era tests
hard-code, so their helpers run here unchanged.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3util

from tierkv.testing.seaweed import FAST_FAIL_CONFIG, MISSING_BINARY, SeaweedServer, find_weed

__all__ = ["COMPAT_CREDENTIALS", "FAST_FAIL_CONFIG", "SeaweedServer", "seaweed", "seaweed_server"]

#: credentials the moto-era tests hard-code, accepted too so their helpers run against this server:
#: ``tests/s3util.py`` (``storage_options``, ``new_bucket``, ``boto_client``) and the URL user info of
#: ``test_fsspec_tier.test_credentials_never_appear_in_reprs_stats_or_logs`` (``AKIAUSER`` and that
#: module's ``SECRET``). Moto accepts any credentials; a real server checks them, so the second one is
#: also what proves that credentials in the URL reach s3fs.
COMPAT_CREDENTIALS: tuple[tuple[str, str], ...] = (
    (s3util.KEY, s3util.SECRET), ("AKIAUSER", "SUPERSECRET123"))


# ---- the process-wide server ---------------------------------------------------------------------
_lock = threading.Lock()
_server: SeaweedServer | None = None
_failure: str | None = None


def seaweed_server() -> SeaweedServer:
    """The process-wide server, started on first call (and restarted if a test left it down or
    frozen). Raises RuntimeError with the reason when it cannot run; a failed start is not retried."""
    global _server, _failure
    with _lock:
        if _failure is not None:
            raise RuntimeError(_failure)
        if _server is None:
            weed = find_weed()
            if weed is None:
                _failure = MISSING_BINARY.format(here=Path(sys.executable).parent)
                raise RuntimeError(_failure)
            server = SeaweedServer(Path(tempfile.mkdtemp(prefix="tkv-seaweed-")), weed, COMPAT_CREDENTIALS)
            atexit.register(_shutdown, server)
            try:
                server.start()
            except Exception as exc:
                _failure = f"SeaweedFS would not start: {exc}"
                raise RuntimeError(_failure) from None
            _server = server
        elif not _server.alive() or _server.frozen:
            _server.restart()
        return _server


def _shutdown(server: SeaweedServer) -> None:
    server.close()
    shutil.rmtree(server.root, ignore_errors=True)


@pytest.fixture
def seaweed() -> Iterator[SeaweedServer]:
    """The session's running SeaweedFS server; fails (never skips) when it cannot run."""
    problem = None
    try:
        server = seaweed_server()
    except RuntimeError as exc:
        problem = str(exc)
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    yield server
