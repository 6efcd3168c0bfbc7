"""Checkpoints of a resumable run (mask learning, weight recovery): where they go, what they hold,
how a run resumes from one, and when they are deleted.

Exact resume: the blocks of step ``k`` are ``gmc.masks.harness.batch_indices(k, ...)``, a function of
``(seed, k)`` alone, and a checkpoint holds the trained module, the optimizer, the step and torch's RNG
state, so a run resumed from any checkpoint reproduces the uninterrupted run bit for bit (same machine,
same thread count). A checkpoint resumes only the run whose ``identity`` it records.

Safety: checkpoints are written atomically (temp file + rename) and loaded with
``weights_only=True`` (a crafted ``state.pt`` cannot run code). The last step is checkpointed too,
and the caller deletes the checkpoint (``remove_checkpoint``) only after its artifact is written,
so a failed write loses nothing: ``--resume`` re-exports it.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from gmc.errors import GmcError
from gmc.formats.atomic import atomic_write_bytes
from gmc.formats.outputs import output_path

if TYPE_CHECKING:
    from gmc.masks.distributed import Dist

STATE_FILE = "state.pt"
LOG_FILE = "train_log.jsonl"
TEACHER_FILE = "teacher.safetensors"  # gmc.masks.teacher's cache, written with each checkpoint


@dataclass(frozen=True)
class Run:
    """One resumable run: where it checkpoints, what a checkpoint must match, how it reports."""

    directory: Path  # holds STATE_FILE and LOG_FILE
    identity: dict  # a checkpoint recording another identity belongs to another run
    steps: int
    checkpoint_every: int
    resume: bool
    label: str  # of the progress bar
    kind: str = "run"  # in messages: "a checkpoint of an earlier run"
    progress: bool = True


def checkpoint_path(output: str, chosen: Optional[str] = None, suffix: str = ".ckpt") -> Path:
    """``chosen`` (``--checkpoint-dir``), else ``OUTPUT<suffix>`` next to the normalised output
    (``-o out/`` and ``-o out`` share ``out.ckpt``)."""
    if chosen:
        return output_path(chosen)
    return output_path(f"{output_path(output)}{suffix}")


def blocks_identity(blocks: torch.Tensor) -> dict:
    """The calibration blocks, as a run identity records them."""
    return {"blocks": list(blocks.shape), "blocks_sum": int(blocks.sum())}


def resume(run: Run, module: torch.nn.Module, optimizer: torch.optim.Optimizer, dist: Optional["Dist"] = None) -> int:
    """Prepare ``run.directory``; return the step to continue from (0: a fresh start).

    With ``run.resume`` the checkpoint's state is loaded into ``module``, ``optimizer`` and torch's
    RNG; without it an existing checkpoint is refused. The log is cut to the resumed step. Under
    ``dist`` rank 0 alone touches the directory and every rank gets the state.
    """
    def prepare():
        state = _load_state(run.directory, run.identity, run.steps) if run.resume else None
        if not run.resume and (run.directory / STATE_FILE).exists():
            raise GmcError(f"{run.directory} holds a checkpoint of an earlier {run.kind}: pass --resume to continue "
                           f"it, or delete it to start over")
        run.directory.mkdir(parents=True, exist_ok=True)
        _truncate_log(run.directory / LOG_FILE, 0 if state is None else int(state["step"]))
        return state

    state = prepare() if dist is None else dist.on_main(prepare)
    if state is None:
        return 0
    module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def save_state(ckpt_dir: Path, identity: dict, module, optimizer, step: int) -> None:
    buffer = io.BytesIO()
    torch.save({"identity": identity, "step": step, "module": module.state_dict(),
                "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, buffer)
    atomic_write_bytes(ckpt_dir / STATE_FILE, buffer.getvalue())


def _load_state(ckpt_dir: Path, identity: dict, steps: int | None = None) -> dict:
    """The checkpoint in ``ckpt_dir`` if it belongs to the run of ``identity`` and is not past ``steps``."""
    path = ckpt_dir / STATE_FILE
    if not path.is_file():
        raise GmcError(f"nothing to resume: no checkpoint {path}")
    try:
        # weights_only: tensors, dicts, lists and numbers only; a pickled object (code) is refused unrun
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many types on a corrupted or unsafe file
        raise GmcError(f"corrupted or unsafe checkpoint {path} ({type(error).__name__}): it is not a plain "
                       f"gmc checkpoint and was not loaded; delete it to start over") from error
    if not (isinstance(state, dict) and isinstance(state.get("identity"), dict) and type(state.get("step")) is int):
        raise GmcError(f"checkpoint {path} is not a gmc training checkpoint (it records no run identity or step); "
                       f"delete it to start over")
    differs = [k for k in identity if state["identity"].get(k) != identity[k]]
    if differs:
        raise GmcError(f"checkpoint {path} belongs to a different run: {', '.join(differs)} differ")
    if steps is not None and state["step"] > steps:
        raise GmcError(f"checkpoint {path} is at step {state['step']}, past --steps {steps}: resume with "
                       f"--steps {state['step']} or more")
    return state


def _truncate_log(log_path: Path, step: int) -> None:
    """Keep the log lines of steps up to ``step`` (the resumed run rewrites the rest). A partial
    last line (the process was killed while writing it) is dropped; a broken earlier line is an error."""
    if not log_path.exists():
        return
    lines = log_path.read_bytes().decode("utf-8", errors="replace").splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line) if line.strip() else None
            record_step = None if record is None else int(record["step"])
        except (ValueError, TypeError, KeyError) as error:
            if number == len(lines):
                break
            raise GmcError(f"corrupted training log {log_path}, line {number}: {type(error).__name__}; "
                           f"delete the checkpoint directory {log_path.parent} to start over") from error
        if record_step is not None and record_step <= step:
            kept.append(line)
    atomic_write_bytes(log_path, "".join(line + "\n" for line in kept).encode())


def remove_checkpoint(ckpt_dir: Path) -> None:
    """Delete a finished run's checkpoint; call it only once its artifact is safely written."""
    for name in (STATE_FILE, LOG_FILE, TEACHER_FILE):
        (ckpt_dir / name).unlink(missing_ok=True)
    try:
        os.rmdir(ckpt_dir)
    except OSError:
        pass
