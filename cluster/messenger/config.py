"""Typed, validated settings of a :class:`~cluster.messenger.messenger.Messenger`."""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("auto", "tcp", "shm", "rdma")

KiB = 1 << 10
MiB = 1 << 20


@dataclass(frozen=True)
class MessengerConfig:
    """Settings of one engine; invalid values raise ``ValueError`` on construction.

    ``slice_bytes`` is the unit a large request is cut into before the slices are spread over the
    ``streams`` TCP connections (Mooncake's ``MC_SLICE_SIZE``); ``message_bytes`` caps how many
    slices ride in one wire message, which amortizes the per-message header and acknowledgement.
    ``timeout_s`` is how long a peer may stay silent while work is pending before the pending
    batches fail. ``shm_copy_threads`` is how many threads (the transport's own included) share the
    copies of one shared-memory chunk; ``memmove`` releases the GIL, so two threads come close to
    ``copy_``'s bandwidth on a small host, and 1 copies on the transport's thread alone.
    """

    secret: bytes
    host: str = "127.0.0.1"
    port: int = 0
    streams: int = 4
    slice_bytes: int = 1 * MiB
    message_bytes: int = 4 * MiB
    checksum: bool = False
    timeout_s: float = 10.0
    transport: str = "auto"
    rdma_device: str | None = None
    rdma_gid_index: int = 0  # RoCE v2 setups often need the index of the IPv4-mapped GID instead
    socket_buffer_bytes: int = 4 * MiB
    shm_copy_threads: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.secret, (bytes, bytearray)) or len(self.secret) < 16:
            raise ValueError("secret must be at least 16 bytes (the shared cluster secret)")
        if not self.host:
            raise ValueError("host must be a non-empty address to listen on")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not 1 <= self.streams <= 64:
            raise ValueError(f"streams must be in 1..64, got {self.streams}")
        if self.slice_bytes < 4 * KiB:
            raise ValueError(f"slice_bytes must be at least 4 KiB, got {self.slice_bytes}")
        if self.message_bytes < self.slice_bytes:
            raise ValueError("message_bytes must be at least slice_bytes")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.rdma_gid_index < 0:
            raise ValueError(f"rdma_gid_index must be non-negative, got {self.rdma_gid_index}")
        if self.socket_buffer_bytes < 64 * KiB:
            raise ValueError("socket_buffer_bytes must be at least 64 KiB")
        if not 1 <= self.shm_copy_threads <= 64:
            raise ValueError(f"shm_copy_threads must be in 1..64, got {self.shm_copy_threads}")
