"""Domain errors of the server and the one place that maps them to gRPC status codes (`status_of`).
Any other exception is a bug: logged with its traceback, answered INTERNAL, and the server keeps serving."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

log = logging.getLogger("serving")


class ServingError(Exception):
    """Base class: an expected failure with a message meant for the caller."""

    code = grpc.StatusCode.INTERNAL


class RequestError(ServingError):
    """The request breaks the contract; the message says what to fix. `field` is the field at fault as
    google.rpc.BadRequest names it (`series[1].close`); `violations` gives several (field, problem) pairs."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, field: str = "", violations: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.violations: tuple[tuple[str, str], ...] = tuple(violations) or ((field, message),)


class ExplainUnavailable(ServingError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(ServingError):
    """More concurrent calls than --max-concurrent; the caller should back off and retry."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ResponseTooLarge(ServingError):
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
VIOLATION_BYTES = 300  # one field violation's description, at most


def _header_length(text: str) -> int:
    """The length of `text` as grpc-message: bytes outside printable ASCII, and '%', percent-encoded."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode("utf-8", "replace"))


def _cut(text: str, limit: int) -> str:
    """`text` within `limit` bytes as grpc-message (which also bounds its UTF-8 size), cut on a character."""
    if _header_length(text) <= limit:
        return text
    sizes = itertools.accumulate(_header_length(ch) for ch in text)
    return text[:sum(1 for size in sizes if size <= limit - 4)] + " ..."


def status_details(exc: BaseException, code: grpc.StatusCode, message: str) -> tuple[tuple[str, str | bytes], ...]:
    """The trailing metadata to end a call with: a request error carries a google.rpc.BadRequest (one field
    violation per problem) in `grpc-status-details-bin`, others none. Capped message and violations keep the
    trailers within the 8 KiB a client accepts by default."""
    if not isinstance(exc, RequestError):
        return ()
    bad = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=f, description=_cut(d, VIOLATION_BYTES))
        for f, d in exc.violations])
    status = status_pb2.Status(code=code.value[0], message=message)  # from_call checks the two messages agree
    status.details.add().Pack(bad)
    return tuple(rpc_status.to_status(status).trailing_metadata)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller gets for `exc`; a bug is logged with its traceback."""
    if isinstance(exc, ServingError):
        return exc.code, _cut(str(exc), MAX_DETAILS_BYTES)
    log.error("answered INTERNAL: %s", type(exc).__name__, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the server log has the details"
