"""The ways an export ends without a model, each mapped to one exit status in __main__."""

from __future__ import annotations


class ExportError(Exception):
    """Base class; the message names the problem and the fix."""

    exit_status = 1


class UsageError(ExportError):
    """Bad arguments or unusable input: exit 2."""

    exit_status = 2


class CheckFailed(ExportError):
    """A check refused the model, or torch could not export it: exit 1."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check} check failed: {message}")


class WriteFailed(ExportError):
    """Every check passed but the files could not be written: exit 1."""
