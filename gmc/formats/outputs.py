"""Where gmc writes: one rule for every output path (``-o``, ``--save-dense``, checkpoints).

gmc never deletes or replaces what it did not write. Every directory it writes carries a
``.gmc-output`` marker naming its kind (``masks``, ``lowered``, ``report``, ``dense``, ...); an
existing path is replaced only when it is a gmc output of the same kind *and* the user passed
``--overwrite`` (without it gmc refuses and says so). An output never equals or contains an
input (model directory, artifact, calibration file) or another output of the same run, and its
parent must be writable before any work starts, so a run fails in a second, not after an hour.

Paths are normalised once (``~`` expanded, absolute, no trailing slash): ``-o out/`` and
``-o out`` are the same output with the same checkpoint directory ``out.ckpt``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, Optional

from gmc.errors import GmcError

MARKER = ".gmc-output"
KINDS = {
    "masks": "a masks artifact",
    "dense": "a dense HF checkpoint",
    "lowered": "a lowered model",
    "onnx": "an ONNX model",
    "report": "a report",
    "eval": "evaluation results",
    "bench": "benchmark results",
    "cache": "a gmc cache entry",
}
# the temporary names of atomic writes: ".NAME.tmp-PID-RANDOM" (and ".NAME.old-PID" while swapping)
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)(?:-[^/]*)?$")


def output_path(path: str | os.PathLike) -> Path:
    """``path`` with ``~`` expanded, made absolute, ``..`` and any trailing slash removed."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def output_kind(path: Path) -> Optional[str]:
    """Which kind of gmc output ``path`` holds; None when it is not one (or is a link)."""
    if path.is_symlink():
        return None
    if path.is_dir():
        marker = _json(path / MARKER) if (path / MARKER).is_file() else None
        return marker.get("kind") if isinstance(marker, dict) else None
    if path.is_file() and path.suffix == ".json":
        document = _json(path)
        if isinstance(document, dict) and {"gmc_version", "models"} <= set(document):
            return "eval"
    if path.is_file() and _bench_results(path):
        return "bench"
    return None


def mark_output(directory: Path, kind: str) -> None:
    """Write the marker that lets a later ``--overwrite`` recognise ``directory`` as gmc's own."""
    from gmc.config import __version__

    (directory / MARKER).write_text(json.dumps({"kind": kind, "gmc_version": __version__}) + "\n")


def check_output(path: str | os.PathLike, kind: str, *, overwrite: bool = False,
                 inputs: Iterable[Optional[str | os.PathLike]] = (), option: str = "-o") -> Path:
    """Refuse an output that would destroy something or cannot be written; returns it normalised.

    ``inputs``: what the command reads (or must keep), of which the output may equal or contain
    none. Hub ids and other names that are not local paths are skipped.
    """
    path = output_path(path)
    for item in inputs:
        if item is not None and contains(path, item):
            raise GmcError(f"{option} {path} would replace {item}, which this command reads or writes: "
                           f"choose an output outside it")
    if path.is_symlink():
        raise GmcError(f"{option} {path} is a symbolic link: gmc does not write through links; choose another path")
    if path.exists():
        found = output_kind(path)
        if found != kind:
            what = f"holds {KINDS[found]} of gmc" if found in KINDS else (
                f"is a {'directory' if path.is_dir() else 'file'} that gmc did not write")
            raise GmcError(f"{option} {path} already exists and {what}; gmc replaces only {KINDS[kind]} it wrote "
                           f"itself (with --overwrite): choose another path or move it away")
        if not overwrite:
            raise GmcError(f"{option} {path} already holds {KINDS[kind]} of gmc: pass --overwrite to replace it, "
                           f"or choose another path")
    check_writable(path, option)
    return path


def check_outputs(output: str | os.PathLike, kind: str, *, inputs: Iterable[Optional[str | os.PathLike]] = (),
                  overwrite: bool = False, dense: Optional[str | os.PathLike] = None,
                  checkpoint: Optional[Path] = None) -> None:
    """``check_output`` for every output of one run, before any work: ``output`` (``-o``), the dense
    HF checkpoint ``dense`` (``--save-dense``) and the checkpoint directory ``checkpoint``, which
    may overlap neither an input nor another output."""
    inputs = list(inputs)
    check_output(output, kind, overwrite=overwrite, inputs=inputs)
    if dense:  # it may lie inside -o, never be or hold it
        dense_path, main = output_path(dense), output_path(output)
        if dense_path == main or dense_path in main.parents:
            raise GmcError(f"--save-dense {dense_path} would replace the artifact -o {main}: choose a directory "
                           f"outside it (or inside it, e.g. {main / 'hf'})")
        check_output(dense, "dense", overwrite=overwrite, inputs=[*inputs, output], option="--save-dense")
    if checkpoint is not None:
        local_inputs = [i for i in inputs if i is not None and Path(i).expanduser().exists()]
        for other in (output, dense, *local_inputs):
            if other and overlaps(checkpoint, other):
                raise GmcError(f"the checkpoint directory {checkpoint} overlaps {other}: pass a --checkpoint-dir "
                               f"outside it")
        check_writable(checkpoint, "--checkpoint-dir")


def check_writable(path: Path, option: str = "-o") -> None:
    """The nearest existing ancestor of ``path`` must be a directory this user can write."""
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise GmcError(f"cannot write {option} {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise GmcError(f"cannot write {option} {path}: {ancestor} is not writable by this user")


def contains(outer: str | os.PathLike, inner: str | os.PathLike) -> bool:
    """True when the local path ``inner`` is ``outer`` or lies inside it (links resolved)."""
    inner_path = Path(inner).expanduser()
    if not inner_path.exists():
        return False
    outer_real, inner_real = output_path(outer).resolve(), inner_path.resolve()
    return outer_real == inner_real or outer_real in inner_real.parents


def overlaps(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when one path is the other or lies inside it (existing or not; links resolved)."""
    a_real, b_real = output_path(a).resolve(), output_path(b).resolve()
    return a_real == b_real or a_real in b_real.parents or b_real in a_real.parents


def remove_stale_temporaries(path: Path) -> None:
    """Remove ``.NAME.tmp-PID-*`` / ``.NAME.old-PID`` next to ``path`` left by dead gmc processes
    (kill -9 mid-write). A live PID's are kept: it may be another gmc writing right now."""
    try:
        siblings = list(path.parent.iterdir())
    except OSError:
        return
    for sibling in siblings:
        match = _TEMPORARY.match(sibling.name)
        if not match or match["name"] != path.name or _alive(int(match["pid"])):
            continue
        if sibling.is_dir() and not sibling.is_symlink():
            shutil.rmtree(sibling, ignore_errors=True)
        else:
            try:
                sibling.unlink()
            except OSError:
                pass


def fsync_tree(directory: Path) -> None:
    """Flush every file and directory under ``directory`` to disk (before the final rename)."""
    for root, _, files in os.walk(directory):
        for name in files:
            _fsync(Path(root) / name, os.O_RDONLY)
        _fsync(Path(root), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable."""
    _fsync(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path, flags: int) -> None:
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # a special file or one that cannot be opened: nothing to flush
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _bench_results(path: Path) -> bool:
    """Whether ``path`` holds ``gmc bench`` results in one of its formats: JSON records with
    ``gmc_version`` and ``test``, a CSV whose header has those columns, or its markdown table, whose
    last line starts with ``gmc bench``."""
    if path.stat().st_size > 64 * 2**20:
        return False
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    lines = text.strip().splitlines() or [""]
    try:
        records = json.loads(text)
    except ValueError:
        records = None
    if isinstance(records, list) and records:
        return all(isinstance(record, dict) and {"gmc_version", "test"} <= set(record) for record in records)
    return {"gmc_version", "test"} <= set(lines[0].split(",")) or (
        lines[0].startswith("| model ") and lines[-1].startswith("gmc bench "))
