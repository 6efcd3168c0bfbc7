"""Atomic outputs: every directory and file gmc writes is built under a temporary name next to its
destination and renamed into place only when complete, so a crash never leaves half an output.

The rules of what may be written where (markers, ``--overwrite``, inputs) live in ``gmc.formats.outputs``.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from gmc.formats.outputs import (
    check_output,
    fsync_directory,
    fsync_tree,
    mark_output,
    remove_stale_temporaries,
    umask,
)

__all__ = ["atomic_dir", "atomic_write_bytes", "fsync_directory"]


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, kind: str, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success move it to ``path``.

    ``path`` may exist only as a gmc output of ``kind`` and with ``overwrite`` (``check_output``).
    The directory and its files get the user's umask (not mkdtemp's 0700, nor the 0600 of a library
    that writes private files, as safetensors' ``save_file`` does); its files and itself are
    fsynced before the rename; leftovers of killed gmc processes next to ``path`` are removed first.
    """
    path = check_output(path, kind, overwrite=overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = _fresh_sibling(path)
    try:
        yield tmp
        _user_modes(tmp)
        mark_output(tmp, kind)
        fsync_tree(tmp)
        check_output(path, kind, overwrite=overwrite)  # again: the body may have run for hours
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    fsync_directory(path.parent)


def _user_modes(directory: Path) -> None:
    """Every file under ``directory`` with the mode the user's umask gives a new file: ``0666 &
    ~umask``, or ``0777 & ~umask`` for one its owner may execute (a compiled library)."""
    mask = umask()
    for file in directory.rglob("*"):
        if file.is_file() and not file.is_symlink():
            mode = file.stat().st_mode & 0o777
            wanted = (0o777 if mode & 0o100 else 0o666) & ~mask
            if wanted != mode:
                file.chmod(wanted)


def _fresh_sibling(path: Path) -> Path:
    """A new empty directory ``.NAME.tmp-PID-RANDOM`` next to ``path``, mode 0777 & ~umask."""
    while True:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a file through a temp file + fsync + rename in the same directory (mode 0666 & ~umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~umask())
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_directory(path.parent)
