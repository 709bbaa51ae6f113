"""Settings of the ``mooncake`` tier (:class:`MooncakeTierConfig`), checked when a store opens."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from tierkv.backends.base import TierConfig, old_name
from tierkv.quantities import MAX_WAIT_S

__all__ = ["MooncakeTierConfig", "local_address", "split_endpoint"]


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"``) as ``(host, port)``; ValueError saying what is wrong."""
    host, sep, port = endpoint.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{endpoint!r} is not host:port (e.g. 10.0.0.5:50051)")
    return host, int(port)


def local_address(master_host: str) -> str:
    """The address of this host that the master's nodes can reach: loopback when the master is on
    loopback, else the source address of the route to the master (no packet is sent)."""
    try:
        if ipaddress.ip_address(master_host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        if master_host == "localhost":
            return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class MooncakeTierConfig(TierConfig):
    """Settings of the ``mooncake`` tier: a Mooncake Store cluster reached through its master."""

    kind: str = "mooncake"
    #: the ``mooncake_master`` RPC endpoint, ``host:port``
    master: str
    #: the transfer protocol between nodes: ``tcp`` anywhere, ``rdma`` where there are RDMA NICs
    protocol: Literal["tcp", "rdma"] = "tcp"
    #: RDMA devices (``mlx5_0,mlx5_1``) for ``protocol: rdma``; empty: all of them
    rdma_devices: str = ""
    #: memory this process contributes to the cluster's pool (objects of any node may be placed in
    #: it; they leave with this process); 0: a client that contributes none
    segment_bytes: NonNegativeInt = 1 << 30
    #: the client's transfer buffer (Mooncake's ``local_buffer_size``)
    buffer_bytes: PositiveInt = 64 << 20
    #: the address other nodes reach this one at; unset: loopback when the master is on loopback,
    #: else this host's address on the route to the master
    local_hostname: str | None = None
    #: Mooncake's metadata service: ``P2PHANDSHAKE`` (none needed), or an etcd / HTTP URL
    metadata_server: str = "P2PHANDSHAKE"
    #: how long a call to the master may take (Mooncake's ``MC_RPC_TIMEOUT_MS``, one value per
    #: process: the environment's, else the first tier's; Mooncake's own default is 30 s), and a
    #: presence probe, a removal or the health check before the tier counts as not answering
    request_timeout_s: float = Field(default=5.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False)
    #: calls in flight to Mooncake (each batch is one blocking call, on its own thread); the tier's
    #: one concurrency setting, as for every tier. ``io_threads``, its old name, is still accepted.
    io_depth: PositiveInt = 4
    #: copies of each object the master places (on different nodes)
    replicas: PositiveInt = 1

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return old_name(data, "io_threads", "io_depth")

    @field_validator("master")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        split_endpoint(v)
        return v.strip()

    @field_validator("local_hostname")
    @classmethod
    def _hostname(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or any(c.isspace() for c in v)):
            raise ValueError(f"{v!r} is not a host name or address")
        return v

    @model_validator(mode="after")
    def _unbounded(self) -> MooncakeTierConfig:
        if self.capacity_bytes is not None:
            raise ValueError("capacity_bytes does not apply to a mooncake tier: the master bounds the "
                             "pool (the nodes' segment_bytes) and evicts")
        return self

    @property
    def hostname(self) -> str:
        """``local_hostname``, or the address derived from the master's (see the field)."""
        return self.local_hostname or local_address(split_endpoint(self.master)[0])
