"""Files written whole or not at all, with the mode any file the user writes gets."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def reader_went_away() -> int:
    """After a BrokenPipeError on stdout (`| head`): silence stdout and return 141, as a shell reports SIGPIPE."""
    _stdout_to_devnull()
    return 141


def print_report(text: str, where: str = "") -> None:
    """Print `text`; if stdout cannot take it (`| head`, a full disk), warn once on stderr and carry on.
    `where`: where else the report can be read."""
    try:
        print(text, flush=True)
    except OSError as exc:
        _stdout_to_devnull()  # also the buffer's flush at exit
        print(f"warning: the report could not be written to stdout ({exc.strerror or exc}); carrying on"
              + (f" ({where})" if where else ""), file=sys.stderr, flush=True)


def _stdout_to_devnull() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    if devnull != sys.stdout.fileno():  # stdout's descriptor was closed already: the open took its number
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_argument(example: str, wrong_suffixes: dict[str, str] | None = None) -> Callable[[str], Path]:
    """An argparse `type` for a file to write: refuses a directory name ('.../') and the `wrong_suffixes`
    (suffix: what writes such a file)."""
    def parse(text: str) -> Path:
        if text.endswith(("/", os.sep)):
            raise argparse.ArgumentTypeError(f"{text!r} ends with '/', a directory: give the file's name, e.g. "
                                             f"{text}{example}")
        path = Path(text)
        if why := (wrong_suffixes or {}).get(path.suffix.lower()):
            raise argparse.ArgumentTypeError(f"{text!r} names {why}; give the file's name, e.g. "
                                             f"{path.with_name(example)}")
        return path
    return parse


def link_note(path: Path) -> str | None:
    """The note for an atomic write over a symbolic link, which replaces the link; None for no link."""
    return (f"note: {path} is a link to {os.readlink(path)}; it becomes a file of its own, the new one (what it "
            "linked to is left as it was)") if path.is_symlink() else None


@contextmanager
def atomic_output(out: Path) -> Iterator[str]:
    """A temporary file beside `out`: renamed to `out` (mode 0o666 less the umask) when the block completes,
    removed on any error, so `out` is never half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
