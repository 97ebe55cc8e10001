"""Errors a transfer can end with.

Every failure a caller sees is a :class:`TransferError`, so code on the KV path can catch one type
and decide (retry elsewhere, recompute the prefix) without knowing which transport ran.
"""

from __future__ import annotations


class TransferError(Exception):
    """A transfer (or a whole batch) failed; memory outside the requested ranges is untouched."""


class RemoteAccessError(TransferError):
    """The owner of a region refused an access: unknown handle, out of bounds, or read-only."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class StaleWrite(RemoteAccessError):
    """The owner refused a write into a guarded range: it named no generation, or one of an
    earlier use of the range (the owner released it; its bytes may belong to someone else now)."""


class ChecksumError(TransferError):
    """A slice arrived with a checksum that does not match its bytes."""


class PeerError(TransferError):
    """The peer is unreachable, closed the connection, or stopped answering within the timeout."""


class AuthenticationError(PeerError):
    """The handshake failed: one side does not hold the shared cluster secret."""


class RdmaUnavailable(TransferError):
    """No usable RDMA stack or device on this host; the message says which, in one line."""


def remote_error(status: int, where: str) -> TransferError:
    """The exception for a non-OK status an owner replied with."""
    from .wire import Status  # protocol has no package imports; importing here keeps errors leaf-level

    reason = {
        Status.UNKNOWN_REGION: "unknown region handle",
        Status.OUT_OF_BOUNDS: "access out of the region's bounds",
        Status.CHECKSUM_MISMATCH: "checksum mismatch",
        Status.READ_ONLY: "region is read-only",
        Status.BAD_REQUEST: "malformed request",
        Status.UNSUPPORTED: "operation not supported by the peer",
        Status.STALE: "the range's use has ended (stale generation)",
    }.get(Status(status), f"status {status}")
    if status == Status.CHECKSUM_MISMATCH:
        return ChecksumError(f"{where}: {reason}")
    if status == Status.STALE:
        return StaleWrite(f"{where}: {reason}", int(status))
    return RemoteAccessError(f"{where}: {reason}", int(status))
