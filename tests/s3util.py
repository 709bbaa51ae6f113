"""A moto S3 server on 127.0.0.1 (a real HTTP endpoint), started once per test session.

Import the fixtures into a test module: ``from s3util import s3_endpoint, s3_bucket``. The server
is a process-wide singleton (started on first use, stopped at exit), so every module that imports
the fixtures shares one server however pytest scopes them.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

KEY, SECRET, REGION = "testing", "testing", "us-east-1"

_lock = threading.Lock()
_server: Any = None
_endpoint: str | None = None


def moto_endpoint() -> str:
    """The URL of the process-wide moto server, starting it on first call."""
    global _server, _endpoint
    with _lock:
        if _endpoint is None:
            for name, value in (("AWS_ACCESS_KEY_ID", KEY), ("AWS_SECRET_ACCESS_KEY", SECRET),
                                ("AWS_DEFAULT_REGION", REGION)):
                os.environ.setdefault(name, value)
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            _server, _endpoint = server, f"http://{host}:{port}"
            atexit.register(server.stop)
        return _endpoint


def storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for the moto endpoint."""
    return {"endpoint_url": endpoint, "key": KEY, "secret": SECRET,
            "client_kwargs": {"region_name": REGION}}


def boto_client(endpoint: str) -> Any:
    """A synchronous boto3 S3 client for the endpoint (the oracle's way in)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY,
                        aws_secret_access_key=SECRET, region_name=REGION)


def new_bucket(endpoint: str) -> str:
    """Create a bucket with a unique name and return it."""
    name = f"tkv-{uuid.uuid4().hex[:12]}"
    boto_client(endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The endpoint URL of the session's moto server."""
    yield moto_endpoint()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket for one test."""
    return new_bucket(s3_endpoint)
