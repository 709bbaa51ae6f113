"""A full disk and a dead S3 endpoint: SGLang's threads get False results, never exceptions, the
failures are counted, and the backend serves again once the storage is back."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sgl_pools import TIERKV, create_backend, fill, keys_of, make_mha, pages, scattered, tokens

#: s3fs settings that make a dead endpoint fail fast: one attempt, short timeouts
FAST_FAIL = {"retries": {"total_max_attempts": 1, "mode": "standard"}, "connect_timeout": 1,
             "read_timeout": 5}
KEY, SECRET, REGION = "testing", "testing", "us-east-1"


def _extra(tier: dict[str, Any], slots: int = 64) -> dict[str, Any]:
    return {**TIERKV, "interface_v1": 1, "cpu_bytes_to_use": 8 << 20, "slots": {"kv": slots},
            "tiers": [tier]}


def _full_disk(tmp_path: Path) -> dict[str, Any]:
    """A local-disk tier behind tierkv's fault-injecting tier: every write fails with ENOSPC (a full
    disk) until the test makes room (``store.tiers[1].enabled = False``)."""
    inner = {"kind": "fsspec", "url": f"file://{tmp_path / 'kv'}"}
    return {"kind": "faulty", "inner": inner, "fail_every": 1, "error": "ENOSPC", "ops": ["put"]}


def test_full_disk(tmp_path: Path, closing: list[Any]) -> None:
    extra = _extra(_full_disk(tmp_path))
    _, host = make_mha("page_first")
    keys = keys_of(tokens(6, seed=21))
    src = scattered(host, 6)
    fill(host, src, seed=210)
    want = pages(host, src)

    a = create_backend(extra, host)
    assert a.batch_set_v1(keys[:3], src[:3 * 16]) == [True] * 3, "held in tierkv's CPU pool"
    a.flush()
    st = a.stats().tiers[1]
    assert st.stores == 0 and st.stores_failed == 3
    assert a.batch_get_v1(keys[:3], scattered(host, 3)) == [True] * 3, "the CPU pool still serves them"
    a.close()

    b = create_backend(extra, host)  # a restart: nothing reached the disk
    closing.append(b)
    assert b.batch_exists(keys[:3]) == 0
    assert b.batch_get_v1(keys[:3], scattered(host, 3)) == [False] * 3
    assert b.counters["prefetch_pages_failed"] == 3

    b.store.tiers[1].enabled = False  # room on the disk again
    assert b.batch_set_v1(keys[3:], src[3 * 16:]) == [True] * 3
    b.flush()
    assert b.stats().tiers[1].stores == 3
    b.close()
    c = create_backend(extra, host)
    closing.append(c)
    dst = scattered(host, 3)
    assert c.batch_exists(keys[3:]) == 3
    assert c.batch_get_v1(keys[3:], dst) == [True] * 3
    assert all(torch.equal(x, y) for x, y in zip(want[3:], pages(host, dst), strict=True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Moto:
    """A moto S3 server on a fixed port that can be stopped and started again (its data stays)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._cls = ThreadedMotoServer
        self._server: Any = None

    def start(self) -> None:
        self._server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


@pytest.fixture
def moto() -> Iterator[_Moto]:
    for name, value in (("AWS_ACCESS_KEY_ID", KEY), ("AWS_SECRET_ACCESS_KEY", SECRET),
                        ("AWS_DEFAULT_REGION", REGION)):
        os.environ.setdefault(name, value)
    m = _Moto()
    m.start()
    yield m
    m.stop()


def test_dead_s3_endpoint(moto: _Moto, closing: list[Any]) -> None:
    import boto3

    bucket = f"tkv-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                 region_name=REGION).create_bucket(Bucket=bucket)
    tier = {"kind": "fsspec", "url": f"s3://{bucket}/kv", "negative_ttl_s": 0.2,
            "storage_options": {"endpoint_url": moto.endpoint, "key": KEY, "secret": SECRET,
                                "client_kwargs": {"region_name": REGION}, "config_kwargs": FAST_FAIL}}
    _, host = make_mha("page_first")
    keys = keys_of(tokens(8, seed=22))
    src = scattered(host, 8)
    fill(host, src, seed=220)
    want = pages(host, src)
    b = create_backend(_extra(tier, slots=4), host)  # 4 pages of CPU pool: the first 4 fall out
    closing.append(b)
    assert b.batch_set_v1(keys[:4], src[:64]) == [True] * 4
    b.flush()
    assert b.batch_set_v1(keys[4:], src[64:]) == [True] * 4
    b.flush()
    assert b.stats().tiers[1].stores == 8

    moto.stop()
    t0 = time.monotonic()
    assert b.batch_get_v1(keys[4:], scattered(host, 4)) == [True] * 4, "the CPU pool still serves"
    assert b.batch_exists(keys[:4]) == 4, "known present (presence is cached)"
    assert b.batch_get_v1(keys[:4], scattered(host, 4)) == [False] * 4
    unseen = keys_of(tokens(2, seed=25))
    assert b.batch_exists(unseen) == 0, "a probe that fails is an answer: absent"
    more = keys_of(tokens(2, seed=23))
    assert b.batch_set_v1(more, src[:32]) == [True, True]
    b.flush()
    assert time.monotonic() - t0 < 30
    st = b.stats().tiers[1]
    assert st.stores_failed == 2 and st.backend.get("read_errors", 0) + st.promotions_failed >= 4
    assert b.counters["prefetch_pages_failed"] == 4

    moto.start()
    time.sleep(0.3)  # failed reads stay misses for negative_ttl_s
    dst = scattered(host, 4)
    assert b.batch_exists(keys[:4]) == 4
    assert b.batch_get_v1(keys[:4], dst) == [True] * 4
    assert all(torch.equal(x, y) for x, y in zip(want[:4], pages(host, dst), strict=True))
    assert b.batch_set_v1(keys_of(tokens(2, seed=24)), src[:32]) == [True, True]
    # the two writes that failed while the endpoint was dead wait in the retry queue and are
    # written once the tier answers, if their pages are still in the 4-page CPU pool; pages the
    # reads above evicted first cannot be, and are counted: nothing is lost uncounted
    deadline = time.monotonic() + 30
    b.flush()
    while b.stats().tiers[1].requeue_waiting and time.monotonic() < deadline:
        time.sleep(0.1)
        b.flush()
    st = b.stats().tiers[1]
    assert (st.up, st.requeue_waiting) == (1, 0)
    assert st.stores + st.stores_requeue_dropped == 12, (st.stores, st.stores_requeue_dropped)
    assert b.batch_exists(more) == st.stores - 10
