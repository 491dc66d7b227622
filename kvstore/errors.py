"""One exception root for Crescent, each class mapped to one gRPC status.

Servers abort with ``err.grpc_code``; clients turn a gRPC status back into the
matching class (``from_grpc``), so callers catch ``CrescentError`` or a precise
subclass and never see raw ``grpc.RpcError`` objects.
"""

from __future__ import annotations

import grpc


class CrescentError(Exception):
    """Root of every error Crescent raises across an API border."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(CrescentError):
    """Bad input: empty or oversized key, oversized value, malformed message."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(CrescentError):
    grpc_code = grpc.StatusCode.NOT_FOUND


class ResourceExhaustedError(CrescentError):
    """No tier can make room: everything resident is leased or pinned, or the disk is full."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DataLossError(CrescentError):
    """Stored bytes failed verification (checksum, header, truncated transfer)."""

    grpc_code = grpc.StatusCode.DATA_LOSS


class ChunkVerificationError(DataLossError):
    """A KV chunk's header or payload does not match what the reader asked for.

    Readers treat it as a miss: a corrupt, stale or colliding chunk is never
    used as KV.
    """


class UnavailableError(CrescentError):
    """The node cannot be reached or is shutting down."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(CrescentError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class FailedPreconditionError(CrescentError):
    """The operation does not fit the node's state (e.g. an expired lease)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class UnauthenticatedError(CrescentError):
    """The server needs a bearer token, and the call carried none it knows (kvstore/auth.py)."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(CrescentError):
    """The call's token lacks the scope the operation needs (kvstore/auth.py)."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


_BY_CODE = {
    cls.grpc_code: cls
    for cls in (
        UnauthenticatedError,
        PermissionDeniedError,
        InvalidArgumentError,
        NotFoundError,
        ResourceExhaustedError,
        DataLossError,
        UnavailableError,
        DeadlineExceededError,
        FailedPreconditionError,
    )
}


LEADER_METADATA = "crescent-leader"


def leader_hint(err: grpc.RpcError) -> str | None:
    """The leader's address a conductor follower named in its UNAVAILABLE answer (trailing
    metadata ``crescent-leader``), or None."""
    if not hasattr(err, "trailing_metadata") or err.code() is not grpc.StatusCode.UNAVAILABLE:
        return None
    return next((v for k, v in err.trailing_metadata() or () if k == LEADER_METADATA), None)


def call_grpc(fn, retry=None):
    """Runs ``fn()`` (one gRPC call), turning a failed status into its CrescentError.

    With a ``kvstore.client.Retry``, UNAVAILABLE is retried with backoff.
    """

    def once():
        try:
            return fn()
        except grpc.RpcError as exc:
            if _cancelled_by_server(exc):
                raise _transient(exc) from None
            raise from_grpc(exc) from None
        except ValueError as exc:  # grpc's answer on a channel another thread closed meanwhile
            if "closed" not in str(exc).lower() or "channel" not in str(exc).lower():
                raise
            raise FailedPreconditionError(f"the client was closed: {exc}") from None

    return retry.call(once) if retry is not None else once()


def _cancelled_by_server(err: grpc.RpcError) -> bool:
    """A CANCELLED this side did not ask for: the server (or its HTTP/2 end, as its process stops)
    reset the call. This side's own say "Locally cancelled" (``cancel()``) or "Channel closed"."""
    if not hasattr(err, "code") or err.code() is not grpc.StatusCode.CANCELLED:
        return False
    details = err.details() or ""
    return not details.startswith(("Locally cancelled", "Channel closed"))


def _transient(err: grpc.RpcError) -> UnavailableError:
    """A call the server cancelled, as UnavailableError: retried like a refused connection (a node
    that stops mid-call resets its calls; before, that surfaced as a bare CrescentError)."""
    exc = UnavailableError(f"CANCELLED by the server: {err.details()} (stopping?)")
    exc.grpc_code = grpc.StatusCode.CANCELLED
    exc.leader = None
    return exc


def from_grpc(err: grpc.RpcError) -> CrescentError:
    """The CrescentError for a failed call (its status code and details)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, CrescentError)
    if code is grpc.StatusCode.UNIMPLEMENTED:  # a store dialled as a conductor, or the other way round
        details = f"{details} (the server there does not serve this call: is it the right kind of server?)"
    exc = cls(f"{code.name}: {details}")
    exc.grpc_code = code
    exc.leader = leader_hint(err) if hasattr(err, "code") else None
    """A conductor follower's answer: the leader's address."""
    return exc
