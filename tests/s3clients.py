"""Both S3 clients for the S3 tests: obstore and s3fs (``s3_client`` of the fsspec tier).

``from s3clients import s3_client`` in a test module; a test (or class) that asks for the fixture
runs once per client, with ``TIERKV_S3_CLIENT`` set, so every ``s3://`` tier the test opens (its
own, a CLI's, a node process's) uses that client, and one that cannot fails rather than falling
back to the other.
"""

from __future__ import annotations

import pytest

from tierkv.backends.fsspec._obstore import ENV_CLIENT

__all__ = ["CLIENTS", "s3_client"]

CLIENTS = ["obstore", "s3fs"]


@pytest.fixture(params=CLIENTS)
def s3_client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The client this run of the test uses (``TIERKV_S3_CLIENT`` is set to it)."""
    client: str = request.param
    monkeypatch.setenv(ENV_CLIENT, client)
    return client
