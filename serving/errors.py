"""Domain errors of the server and the one place that maps them to gRPC status codes.

Pure functions and modules raise these; the servicer catches them in one decorator
(`serving.servicer.rpc`) and answers with `status_of(exc)`. Anything else is a bug: it is
logged with its traceback and answered INTERNAL, and the server keeps serving.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


class ServingError(Exception):
    """Base class: an expected failure with a message meant for the caller."""

    code = grpc.StatusCode.INTERNAL


class RequestError(ServingError):
    """The request breaks the contract; the message says what to fix.

    `field` names the request field at fault as google.rpc.BadRequest paths name them (`series[1].close`,
    `series[0].symbol`, `series`, `request_id`); `violations` gives several (field, what is wrong) pairs
    instead, one per problem the message lists."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, field: str = "", violations: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.violations: tuple[tuple[str, str], ...] = tuple(violations) or ((field, message),)


class ExplainUnavailable(ServingError):
    """`explain` asked of a model exported without its interpretability outputs."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(ServingError):
    """More concurrent calls than --max-concurrent; the caller should back off and retry."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ResponseTooLarge(ServingError):
    """The answer would exceed --max-message-bytes; the caller should send fewer series (or no explain)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class QueueDeadlineExceeded(ServingError):
    """The call's deadline passed while it waited for a batch; it was not run."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotReady(ServingError):
    """Warming up or shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class ModelLoadError(Exception):
    """A model file that cannot be served (unreadable, wrong inputs, bad metadata, wrong device).

    At start-up it stops the server with this message; on SIGHUP the old model keeps serving.
    """


class DeviceUnavailable(ModelLoadError):
    """`--device cuda` without a working CUDA execution provider."""


class ConfigError(Exception):
    """A flag or file the server (or a client) cannot use: unreadable TLS files, a bad token file.

    Stops the command at start with this message (exit 2); on SIGHUP the old setting stays.
    """


MAX_DETAILS_BYTES = 2000  # status messages are cut here: they travel in a trailer (gRPC: 8 KiB of metadata)


def bounded(text: str, limit: int = 48) -> str:
    """`text` as a quoted literal (control characters escaped) of at most about `limit` characters.

    Every string from a request that an error message repeats goes through this, so a message
    stays short however long or strange the caller's string is.
    """
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def cap_details(message: str) -> str:
    """A status message that fits its trailer: at most MAX_DETAILS_BYTES of UTF-8, cut on a character."""
    data = message.encode("utf-8", "replace")
    if len(data) <= MAX_DETAILS_BYTES:
        return message
    return data[:MAX_DETAILS_BYTES - 20].decode("utf-8", "ignore") + " ... (message cut)"


METADATA_BYTES = 8192 - 512  # a client's default limit on trailing metadata, less room for the other trailers
VIOLATION_BYTES = 300  # one field violation's description, at most


def _cut(text: str, limit: int) -> str:
    data = text.encode("utf-8", "replace")
    return text if len(data) <= limit else data[:max(0, limit - 4)].decode("utf-8", "ignore") + " ..."


def _header_length(message: str) -> int:
    """The length of grpc-message on the wire: bytes outside printable ASCII, and '%', percent-encoded."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in message.encode("utf-8", "replace"))


def status_details(exc: BaseException, code: grpc.StatusCode,
                   message: str) -> tuple[str, tuple[tuple[str, str | bytes], ...]]:
    """The status message and the trailing metadata to end a call with. For a request error, gRPC's richer error
    model: `grpc-status-details-bin` holding a google.rpc.Status whose details hold a google.rpc.BadRequest, one
    field violation per problem (the field's path, e.g. series[1].close, and what is wrong), so that a client
    finds the series at fault without parsing the message (Python: grpc_status.rpc_status.from_call; Go:
    status.FromError(err).Details(); Java: StatusProto.fromThrowable). Other errors carry none: ().

    The trailers must stay within the 8 KiB of metadata a client accepts by default (past it the call fails
    without its status), and the details' message must be the status message (from_call refuses a call whose
    two differ). What does not fit is given up in this order: the violations' descriptions, then the end of the
    message, in both places alike."""
    if not isinstance(exc, RequestError):
        return message, ()
    violations = [(f, _cut(d, VIOLATION_BYTES)) for f, d in exc.violations]
    for described in (True, False):
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=d if described else "")
            for f, d in violations])
        if _trailer_length(message, bad) <= METADATA_BYTES:
            break
    while _trailer_length(message, bad) > METADATA_BYTES and len(message) > 8:  # a long non-ASCII message
        message = _cut(message, len(message.encode("utf-8", "replace")) * 4 // 5)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(bad)
    return message, tuple(rpc_status.to_status(status).trailing_metadata)


def _trailer_length(message: str, bad: error_details_pb2.BadRequest) -> int:
    """grpc-message and grpc-status-details-bin on the wire: the message percent-encoded, the details in base64."""
    status = status_pb2.Status(code=3, message=message)
    status.details.add().Pack(bad)
    return _header_length(message) + (status.ByteSize() + 2) // 3 * 4


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller gets for `exc`."""
    if isinstance(exc, ServingError):
        return exc.code, cap_details(str(exc))
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the server log has the details"
