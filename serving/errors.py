"""Domain errors of the server and the one place that maps them to gRPC status codes.

Pure functions and modules raise these; the servicer catches them in one decorator
(`serving.servicer.rpc`) and answers with `status_of(exc)`. Anything else is a bug: it is
logged with its traceback and answered INTERNAL, and the server keeps serving.
"""

from __future__ import annotations

import grpc


class ServingError(Exception):
    """Base class: an expected failure with a message meant for the caller."""

    code = grpc.StatusCode.INTERNAL


class RequestError(ServingError):
    """The request breaks the contract; the message says what to fix."""

    code = grpc.StatusCode.INVALID_ARGUMENT


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


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller gets for `exc`."""
    if isinstance(exc, ServingError):
        return exc.code, cap_details(str(exc))
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the server log has the details"
