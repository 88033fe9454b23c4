"""All-or-nothing output: everything is staged beside its target and renamed into place at the end.

`commit` replaces the model directory first and the model file last, rolling the directory back
if the file fails; before `commit`, nothing but staged temporaries exists.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from features.files import umask


def _write(path: Path, data: bytes, mode: int) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(path, mode)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the file system allows one, else a copy; a symbolic link stays one."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def leftovers(target: Path) -> tuple[list[Path], list[Path]]:
    """What a killed export left beside `target`: staged copies and backups of a replaced directory."""
    if not target.parent.is_dir():
        return [], []
    name = re.escape(target.name)
    staged_name = re.compile(rf"\.{name}\.[a-z0-9_]{{8}}\.tmp")  # tempfile's names, as Staging makes them
    backup_name = re.compile(rf"\.{name}\.old-[0-9a-f]{{8}}")
    entries = sorted(target.parent.iterdir())
    return ([p for p in entries if staged_name.fullmatch(p.name)],
            [p for p in entries if backup_name.fullmatch(p.name) and p.is_dir()])


@contextlib.contextmanager
def _naming(target: Path) -> Iterator[None]:
    """An OSError inside names `target` rather than a staged path or nothing (a full disk's write())."""
    try:
        yield
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(target)) from exc


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class Staging:
    """Stage files and directories; `commit()` publishes them, `discard()` (or an exception) removes them."""

    def __init__(self) -> None:
        self._files: list[tuple[Path, Path]] = []  # (staged, target)
        self._dirs: list[tuple[Path, Path]] = []
        self._created_parents: list[Path] = []
        self._mode = 0o666 & ~umask()

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()

    def _parents(self, target: Path) -> None:
        """Make `target`'s missing directories; discard() removes them again."""
        if not target.parent.exists():
            missing = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
            target.parent.mkdir(parents=True)
            self._created_parents.extend(missing)  # deepest first

    def file(self, target: Path, data: bytes) -> None:
        with _naming(target):
            self._parents(target)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            os.close(fd)
            self._files.append((Path(tmp), target))
            _write(Path(tmp), data, self._mode)

    def directory(self, target: Path, files: dict[str, bytes], keep_others: bool = False) -> None:
        """Stage `target` holding `files` (relative path -> content). With `keep_others`, the other entries of
        an existing `target` (Triton versions, labels) are linked into the staged copy, so the swap keeps them."""
        with _naming(target):
            self._parents(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
            self._dirs.append((tmp, target))
            os.chmod(tmp, 0o777 & ~umask())
            for rel, data in files.items():
                path = tmp / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                _write(path, data, self._mode)
            if keep_others and target.is_dir():
                ours = {Path(rel).parts[0] for rel in files}
                for entry in [e for e in target.iterdir() if e.name not in ours]:
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.copytree(entry, tmp / entry.name, symlinks=True, copy_function=_link_or_copy)
                    else:
                        _link_or_copy(str(entry), str(tmp / entry.name))

    def commit(self, published: list[Path] | None = None) -> None:
        """Publish directories (swapping out any old one), then files; on any error the swapped directories go
        back. The targets are added to `published` once all are in place."""
        swapped: list[tuple[Path, Path, Path | None]] = []  # (staged, target, backup)
        try:
            for staged, target in self._dirs:
                with _naming(target):
                    backup = None
                    if target.exists():
                        backup = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
                        os.rename(target, backup)
                    swapped.append((staged, target, backup))
                    os.rename(staged, target)
            for staged, target in self._files:
                with _naming(target):
                    os.replace(staged, target)
            if published is not None:
                published.extend([t for _, t in self._dirs] + [t for _, t in self._files])
        except BaseException:
            for staged, target, backup in reversed(swapped):
                if not staged.exists() and target.exists():
                    os.rename(target, staged)
                if backup is not None:
                    os.rename(backup, target)
            raise
        for parent in {t.parent for _, t in self._dirs + self._files}:
            _fsync_dir(parent)
        for _, _, backup in swapped:
            if backup is not None:
                remove(backup)
        self._files, self._dirs, self._created_parents = [], [], []

    def discard(self) -> None:
        for staged, _ in self._files:
            staged.unlink(missing_ok=True)
        for staged, _ in self._dirs:
            shutil.rmtree(staged, ignore_errors=True)
        for parent in sorted(set(self._created_parents), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # deepest first; one holding something else stays
                parent.rmdir()
        self._files, self._dirs, self._created_parents = [], [], []
