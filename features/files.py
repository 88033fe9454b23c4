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
    """After a BrokenPipeError on stdout (`| head`): stdout goes to /dev/null, so the flush at exit raises no
    second error, and the status is 141, as a shell reports for a process SIGPIPE ended."""
    _stdout_to_devnull()
    return 141


def print_report(text: str, where: str = "") -> None:
    """Print `text` to stdout for a command whose work outlives its report: if stdout cannot take it (`| head`,
    a full disk), the rest of stdout goes to /dev/null, stderr says so once, and the work goes on. `where`:
    where else the report can be read."""
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
    """The process's file-creation mask (read by setting it, then setting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_argument(example: str, wrong_suffixes: dict[str, str] | None = None) -> Callable[[str], Path]:
    """An argparse `type` for a file to write: refuses a name that ends with '/' and, from `wrong_suffixes`
    (suffix: what writes such a file), a name for another command's kind of file."""
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


def unwritable(target: Path) -> tuple[Path, str] | None:
    """Whether a file can be made at `target`, found before any long work: the nearest existing directory on
    its way must take a file. None when it does, else (that directory, why not). A real file is made and
    removed, since permission bits do not tell (root, read-only mounts)."""
    existing = target.parent
    try:
        existing = next(p for p in (target.parent, *target.parent.parents) if p.exists() or p.is_symlink())
        if not existing.exists():
            return existing, f"{existing} is a link to {os.readlink(existing)}, which does not exist"
        if not existing.is_dir():
            return existing, f"{existing} is a file"
        # a name the commands' clean-up knows (.NAME.XXXXXXXX.tmp), should a kill leave it
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:  # a directory on the way that cannot be searched, a read-only file system ...
        return existing, str(exc.strerror or exc)
    return None


def link_note(path: Path) -> str | None:
    """What an atomic write does to `path` when it is a symbolic link (the rename replaces the link itself);
    None when `path` is no link."""
    if not path.is_symlink():
        return None
    return (f"note: {path} is a link to {os.readlink(path)}; it becomes a file of its own, the new one (what it "
            "linked to is left as it was)")


@contextmanager
def atomic_output(out: Path) -> Iterator[str]:
    """A temporary file beside `out` to write; when the block completes it becomes `out` (mode 0o666 less the
    umask, as open() makes it), and on any error, Ctrl-C included, it is removed: `out` is never half-written."""
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
