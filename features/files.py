"""Files written whole or not at all, with the mode any file the user writes gets."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def umask() -> int:
    """The process's file-creation mask (read by setting it, then setting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def unwritable(target: Path) -> tuple[Path, str] | None:
    """Whether a file can be made at `target`, found before any long work and creating nothing: the nearest
    existing directory on its way (the command makes the rest when it writes) must take a file. None when it
    does, else (that directory, why not). A real file is made and removed, since permission bits do not tell
    (root, read-only mounts, immutable directories)."""
    existing = next(p for p in (target.parent, *target.parent.parents) if p.exists() or p.is_symlink())
    try:
        if not existing.exists():
            raise FileNotFoundError(f"it is a link to {os.readlink(existing)}, which does not exist")
        if not existing.is_dir():
            raise NotADirectoryError("it is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return existing, str(exc.strerror or exc)
    return None


@contextmanager
def atomic_output(out: Path) -> Iterator[str]:
    """A temporary file beside `out` to write; when the block completes it becomes `out` (mode 0o666 less the
    umask, as an open() would make it: mkstemp makes it private), and on any error, Ctrl-C included, it is
    removed, so `out` is never half-written."""
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
