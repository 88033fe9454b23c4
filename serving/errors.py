"""Domain errors of the server and the one place that maps them to gRPC status codes.

The servicer's `rpc` decorator answers with `status_of(exc)`. Anything else is a bug: logged with
its traceback and answered INTERNAL, and the server keeps serving.
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

    `field` is the field at fault as google.rpc.BadRequest paths name it (`series[1].close`); `violations`
    gives several (field, what is wrong) pairs instead, one per problem the message lists."""

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
    """A model file that cannot be served. At start it stops the server; on SIGHUP the old model keeps serving."""


class DeviceUnavailable(ModelLoadError):
    """`--device cuda` without a working CUDA execution provider."""


class ConfigError(Exception):
    """A flag or file the server or client cannot use (TLS, tokens): exit 2 at start; on SIGHUP the old one stays."""


MAX_DETAILS_BYTES = 2000  # status messages are cut here: they travel in a trailer (gRPC: 8 KiB of metadata)
MAX_PROBLEMS = 5  # problems one RequestError lists


def bounded(text: str, limit: int = 48) -> str:
    """`text` as a quoted literal (control characters escaped) of at most about `limit` characters: how an error
    message repeats a caller's string."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def _header_length(text: str) -> int:
    """The length of `text` as grpc-message: bytes outside printable ASCII, and '%', percent-encoded."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode("utf-8", "replace"))


def cap_details(message: str) -> str:
    """A status message of at most MAX_DETAILS_BYTES on the wire (percent-encoded), cut on a character."""
    if _header_length(message) <= MAX_DETAILS_BYTES:
        return message
    room, kept = MAX_DETAILS_BYTES - 20, []
    for ch in message:
        room -= _header_length(ch)
        if room < 0:
            break
        kept.append(ch)
    return "".join(kept) + " ... (message cut)"


VIOLATION_BYTES = 300  # one field violation's description, at most


def status_details(exc: BaseException, code: grpc.StatusCode,
                   message: str) -> tuple[str, tuple[tuple[str, str | bytes], ...]]:
    """The status message and the trailing metadata to end a call with. A request error carries a
    google.rpc.BadRequest in `grpc-status-details-bin`, one field violation per problem, so that a client
    finds the field at fault without parsing the message; other errors carry none.

    A message capped by status_of and at most MAX_PROBLEMS violations of VIOLATION_BYTES keep the trailers
    within the 8 KiB of metadata a client accepts by default."""
    if not isinstance(exc, RequestError):
        return message, ()
    bad = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=f, description=_cut(d, VIOLATION_BYTES))
        for f, d in exc.violations])
    status = status_pb2.Status(code=code.value[0], message=message)  # from_call checks the two messages agree
    status.details.add().Pack(bad)
    return message, tuple(rpc_status.to_status(status).trailing_metadata)


def _cut(text: str, limit: int) -> str:
    data = text.encode("utf-8", "replace")
    return text if len(data) <= limit else data[:max(0, limit - 4)].decode("utf-8", "ignore") + " ..."


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller gets for `exc`."""
    if isinstance(exc, ServingError):
        return exc.code, cap_details(str(exc))
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the server log has the details"
