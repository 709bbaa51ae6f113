"""The tier conformance suite against the fsspec tier on file://, memory:// and s3:// (moto, real HTTP)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
from s3clients import CLIENTS
from s3util import boto_client, new_bucket, s3_endpoint, storage_options

from tierkv.backends.base import Tier
from tierkv.backends.fsspec._tier import FsspecTier, record_path
from tierkv.records import decode_record, encode_record
from tierkv.testing import TierTests

__all__ = ["s3_endpoint"]  # the fixture, imported for this module


def _record(tier: Tier, key: bytes, data: bytes) -> bytes:
    return encode_record(key=key, fingerprint=tier.context.fingerprint, payload=data)


def _decode(tier: Tier, key: bytes, blob: bytes | None) -> bytes | None:
    if blob is None:
        return None
    return decode_record(blob, key=key, fingerprint=tier.context.fingerprint,
                         max_raw_bytes=len(blob)).tobytes()


class TestFsspecFile(TierTests):
    """``file://`` URLs: records through os calls."""

    kind = "fsspec"
    reports_rows = True

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "tier"

    def tier_config(self) -> dict[str, Any]:
        return {"kind": "fsspec", "url": f"file://{self.dir}", "codec": "zstd"}

    async def oracle_set(self, tier: Tier, group: int, key: bytes, data: bytes) -> None:
        path = record_path(str(self.dir), tier.context.fingerprint, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(_record(tier, key, data))

    async def oracle_get(self, tier: Tier, group: int, key: bytes) -> bytes | None:
        path = record_path(str(self.dir), tier.context.fingerprint, key)
        try:
            with open(path, "rb") as f:
                return _decode(tier, key, f.read())
        except FileNotFoundError:
            return None


class TestFsspecMemory(TierTests):
    """``memory://`` URLs: a synchronous fsspec file system (temporary name, then move)."""

    kind = "fsspec"
    reports_rows = True

    @pytest.fixture(autouse=True)
    def _root(self) -> None:
        self.root = f"/tkv-{uuid.uuid4().hex}"

    def tier_config(self) -> dict[str, Any]:
        return {"kind": "fsspec", "url": f"memory://{self.root}", "codec": "zstd-shuffle"}

    async def oracle_set(self, tier: Tier, group: int, key: bytes, data: bytes) -> None:
        fs = fsspec.filesystem("memory")
        fs.pipe_file(record_path(self.root, tier.context.fingerprint, key), _record(tier, key, data))

    async def oracle_get(self, tier: Tier, group: int, key: bytes) -> bytes | None:
        fs = fsspec.filesystem("memory")
        try:
            return _decode(tier, key, fs.cat_file(record_path(self.root, tier.context.fingerprint, key)))
        except FileNotFoundError:
            return None


class TestFsspecS3(TierTests):
    """``s3://`` URLs against moto's HTTP server, once per client (``s3_client``: obstore, s3fs)."""

    kind = "fsspec"
    reports_rows = True

    @pytest.fixture(autouse=True, params=CLIENTS)
    def _bucket(self, s3_endpoint: str, request: pytest.FixtureRequest) -> None:
        self.endpoint = s3_endpoint
        self.bucket = new_bucket(s3_endpoint)
        self.client = request.param

    def tier_config(self) -> dict[str, Any]:
        return {"kind": "fsspec", "url": f"s3://{self.bucket}/kv", "codec": "none",
                "storage_options": storage_options(self.endpoint), "s3_client": self.client}

    def _object(self, tier: Tier, key: bytes) -> str:
        assert isinstance(tier, FsspecTier)
        return record_path("kv", tier.context.fingerprint, key)

    async def oracle_set(self, tier: Tier, group: int, key: bytes, data: bytes) -> None:
        boto_client(self.endpoint).put_object(Bucket=self.bucket, Key=self._object(tier, key),
                                              Body=_record(tier, key, data))

    async def oracle_get(self, tier: Tier, group: int, key: bytes) -> bytes | None:
        client = boto_client(self.endpoint)
        try:
            body = client.get_object(Bucket=self.bucket, Key=self._object(tier, key))["Body"].read()
        except client.exceptions.NoSuchKey:
            return None
        return _decode(tier, key, body)
