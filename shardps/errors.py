"""The shardps error hierarchy: one root, a few subclasses, each mapped to one gRPC status.

Plain classes raise these; the transport maps them to status codes (``shardps.rpc.status``)
and the client maps status codes back, so a raw ``grpc.RpcError`` never escapes the library.
Messages name the bad value and say what to do.
"""

from __future__ import annotations


class ShardpsError(Exception):
    """Root of every error shardps raises. ``code`` is the gRPC status code's name.

    An error a remote call failed with (``shardps.rpc.status.from_rpc_error``) also keeps
    ``status``, the name of the status code the call ended with (CANCELLED reads as
    Unavailable, codes shardps does not use as Internal), and ``details``, the peer's text;
    errors raised locally have None and ""."""

    code = "UNKNOWN"
    status: str | None = None
    details: str = ""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(ShardpsError):
    """Malformed input: wrong dtype, shape or length, out-of-range ids, NaN gradients."""

    code = "INVALID_ARGUMENT"


def non_finite(table: str, value: float, where: str) -> InvalidArgument:
    """The refusal of a NaN or infinity at ``where`` (the sender's place of it, such as
    "element 4095 of the gradient") in values for ``table``: the one wording of the rule,
    for clients and servers."""
    return InvalidArgument(
        f"{where} for table {table!r} is {value}: NaN/Inf gradients are refused unless the "
        f"table's config sets allow_non_finite; nothing of the request was applied")


class UnknownRegion(InvalidArgument):
    """A shared-memory region this server does not know for the job: never proved to it with
    ProbeSharedMemory, or proved to a process that has since restarted. Prove it again (the
    client does, and sends that call's bytes another way)."""


class NotFound(ShardpsError):
    """Unknown job, table, server or session."""

    code = "NOT_FOUND"


class AlreadyExists(ShardpsError):
    """A table or job exists with a different spec."""

    code = "ALREADY_EXISTS"


class FailedPrecondition(ShardpsError):
    """The system is not in the state the request needs (see StaleEpoch)."""

    code = "FAILED_PRECONDITION"


class StaleEpoch(FailedPrecondition):
    """The request was routed with an old shard map: refresh the map and retry."""


class ResourceExhausted(ShardpsError):
    """A size limit or quota was exceeded; the message names it. ``retry_after``: seconds
    after which a retry may be admitted (None: waiting does not help, e.g. a quota)."""

    code = "RESOURCE_EXHAUSTED"
    retry_after: float | None = None


class Unavailable(ShardpsError):
    """The peer is down, starting, fenced or loading; retry with backoff."""

    code = "UNAVAILABLE"


class DeadlineExceeded(ShardpsError):
    """The call's deadline passed."""

    code = "DEADLINE_EXCEEDED"


class Unauthenticated(ShardpsError):
    """No valid token was presented."""

    code = "UNAUTHENTICATED"


class PermissionDenied(ShardpsError):
    """The token does not grant this operation on this job."""

    code = "PERMISSION_DENIED"


class DataLost(ShardpsError):
    """Parameters are gone: every replica of the blocks the request touches died before
    another copy existed. The message names the table, the blocks, the server and the ways
    out (restore the job from a checkpoint, or reset the table's lost blocks)."""

    code = "DATA_LOSS"


class Internal(ShardpsError):
    """A bug in shardps: please report it with the message."""

    code = "INTERNAL"


ERRORS_BY_CODE: dict[str, type[ShardpsError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Unauthenticated,
        PermissionDenied,
        DataLost,
        Internal,
    )
}


# The error's identity on the wire: servers send the class name under this trailing-metadata
# key beside the status code, so a client tells a StaleEpoch from another FAILED_PRECONDITION
# without reading the message.
WIRE_KEY = "x-shardps-error"
ERRORS_BY_NAME: dict[str, type[ShardpsError]] = {
    cls.__name__: cls for cls in (*ERRORS_BY_CODE.values(), StaleEpoch, UnknownRegion)
}
