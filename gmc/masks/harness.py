"""The run harness: what mask learning (``gmc.masks.learn``) and weight recovery (``gmc.masks.recover``) share.

Both are self-distillation runs of ``steps`` optimizer steps over calibration blocks:

    start = resume(run, module, optimizer)        # 0, or the step of run's checkpoint (state loaded)
    run_steps(run, step, start, module, optimizer, postfix)
        each step k:  loss, record = step(k)      # the caller's update, on batch_indices(k)
                      record -> LOG_FILE, progress bar
                      every checkpoint_every steps, at the last one and on SIGINT/SIGTERM: STATE_FILE

Exact resume: the blocks of step ``k`` are ``batch_indices(k, ...)``, a function of ``(seed, k)``
alone, and a checkpoint holds the trained module, the optimizer, the step and torch's RNG state,
so a run resumed from any checkpoint reproduces the uninterrupted run bit for bit (same machine,
same thread count). A checkpoint resumes only the run whose ``identity`` it records.

Safety: checkpoints are written atomically (temp file + rename) and loaded with
``weights_only=True`` (a crafted ``state.pt`` cannot run code). A first SIGINT/SIGTERM finishes
the step and checkpoints it; a second stops at once, keeping the last checkpoint. The last step
is checkpointed too, and the caller deletes the checkpoint (``remove_checkpoint``) only after its
artifact is written, so a failed write loses nothing: ``--resume`` re-exports it.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch
from tqdm.auto import tqdm

from gmc.errors import GmcError, Interrupted
from gmc.formats.atomic import atomic_write_bytes
from gmc.formats.outputs import output_path

if TYPE_CHECKING:
    from gmc.masks.distributed import Dist

STATE_FILE = "state.pt"
LOG_FILE = "train_log.jsonl"
RATE_KEYS = ("tok_per_s", "tok_per_cpu_s")  # the log record's throughput: the host's, not the run's
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


def batch_indices(step: int, batch_size: int, n_blocks: int, seed: int) -> torch.Tensor:
    """Block indices of ``step`` (1-based): epochs of seeded permutations, a pure function."""
    first = (step - 1) * batch_size
    indices = []
    for k in range(first, first + batch_size):
        epoch, position = divmod(k, n_blocks)
        order = list(range(n_blocks))
        random.Random(seed * 7919 + epoch).shuffle(order)
        indices.append(order[position])
    return torch.tensor(indices)


class _SoftCrossEntropy(torch.autograd.Function):
    """``-mean_t sum_v softmax(t)_v log_softmax(s)_v`` computed ``chunk`` tokens at a time.

    Autograd of the plain expression would keep ``[tokens, V]`` fp32 softmax and log-softmax
    copies of both logits; here forward and backward each hold one chunk at a time, and the
    backward writes ``(softmax(s) - softmax(t)) / N`` straight into the gradient.
    """

    @staticmethod
    def forward(ctx, student, teacher, chunk):
        s2, t2 = student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1])
        total = student.new_zeros((), dtype=torch.float32)
        for i in range(0, s2.shape[0], chunk):
            p_t = torch.softmax(t2[i:i + chunk].float(), -1)
            total += -(p_t * torch.log_softmax(s2[i:i + chunk].float(), -1)).sum()
        ctx.save_for_backward(student, teacher)
        ctx.chunk = chunk
        return total / s2.shape[0]

    @staticmethod
    def backward(ctx, grad):
        student, teacher = ctx.saved_tensors
        s2, t2 = student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1])
        out = torch.empty_like(s2)
        scale = grad / s2.shape[0]
        for i in range(0, s2.shape[0], ctx.chunk):
            diff = torch.softmax(s2[i:i + ctx.chunk].float(), -1) - torch.softmax(t2[i:i + ctx.chunk].float(), -1)
            out[i:i + ctx.chunk] = (diff * scale).to(out.dtype)
        return out.view_as(student), None, None


def soft_cross_entropy(student: torch.Tensor, teacher: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Self-distillation loss over the full vocabulary, averaged over tokens."""
    return _SoftCrossEntropy.apply(student, teacher.detach(), chunk)


PRECISIONS = ("auto", "bf16", "fp32")


def resolve_precision(precision: str, device) -> str:
    """``auto``: bf16 on CUDA, fp32 on CPU. ``bf16`` on a CPU with native bf16 dot products (AVX512-BF16,
    AMX) makes a run 1.37x cheaper, but over four seeds on the bundled SmolLM2 it diverged once
    (1,616.74 held-out against fp32's 344.04) and matched fp32 on the others (docs/learning.md)."""
    if precision != "auto":
        return precision
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def autocast(device, precision: str):
    """bf16 autocast of the forward's GEMMs (``precision`` ``bf16``, or ``auto`` resolved), else fp32.
    Weights, optimizer states and the loss stay fp32."""
    device = torch.device(device)
    enabled = resolve_precision(precision, device) == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class Student:
    """``student(batch)``: the model's forward, compiled by Inductor (``torch.compile``: forward and
    backward, their elementwise work fused around the GEMMs) or eager.

    The first compiled call compiles (minutes on a small CPU; Inductor's cache makes a rerun on the
    same machine quicker); if compiling fails -- no C++ compiler, an unsupported op -- the run
    continues eager and says why. Compiled and eager steps give the same gradients to float
    rounding (tests/masks/test_learn.py), not bit for bit, so the choice is part of a run's identity.
    """

    def __init__(self, model: torch.nn.Module, compiled: bool):
        self.model = model
        self.compiled = torch.compile(model) if compiled else None

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            try:
                return self.compiled(batch)
            except Exception as error:  # noqa: BLE001 - any compile failure falls back to eager
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                tqdm.write(f"gmc: compiling the training step failed ({first[:200]}); running it eager")
                self.compiled = None
        return self.model(batch)


def adamw(params, device, optim_8bit: bool, **kwargs) -> torch.optim.Optimizer:
    """AdamW over ``params``, or bitsandbytes' 8-bit AdamW (CUDA only) with ``optim_8bit``."""
    if optim_8bit:
        if torch.device(device).type != "cuda":
            raise GmcError("--optim-8bit needs a CUDA device (bitsandbytes); drop it on CPU")
        try:
            import bitsandbytes as bnb
        except ImportError as error:
            raise GmcError("--optim-8bit needs bitsandbytes: pip install 'gmc[bnb]'") from error
        return bnb.optim.AdamW8bit(params, **kwargs)
    params = list(params)
    # fused: one pass over each tensor, where the default CPU AdamW makes a dozen (0.09 vs 1.0 s a step on
    # SmolLM2's 212M-parameter head, 2 threads, AMD EPYC); sharded (DTensor) parameters keep the default
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    fused = all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point() for t in tensors)
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


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


def run_steps(run: Run, step: Callable[[int], tuple[float, dict]], start: int, module: torch.nn.Module,
              optimizer: torch.optim.Optimizer, postfix: Callable[[dict], dict], dist: Optional["Dist"] = None,
              tokens_per_step: Optional[int] = None, on_checkpoint: Optional[Callable[[int], None]] = None) -> None:
    """Run ``step(k)`` for ``k = start + 1 .. run.steps``; it returns the loss and the log record.

    Rank 0 alone logs and checkpoints (``module``, ``optimizer``). ``tokens_per_step``: add the
    throughput since ``start`` to each record, per second (``tok_per_s``) and per CPU-second of
    this process, all its threads (``tok_per_cpu_s``). ``on_checkpoint(k)`` runs after the checkpoint of
    step ``k`` is written. Raises ``Interrupted`` on SIGINT/SIGTERM (single process) and
    ``GmcError`` on a non-finite loss, naming the checkpoint to resume from.
    """
    main = dist is None or dist.main
    log_path = run.directory / LOG_FILE
    bar = tqdm(total=run.steps, initial=start, desc=run.label, unit="step", disable=not (run.progress and main))
    started, saved = time.perf_counter(), start  # saved: the step of the checkpoint on disk (0: none)
    cpu_started = time.process_time()
    stop_requested: list[int] = []  # signals received while training (rebound by deferred_stop)
    try:
        with open(log_path, "a") if main else contextlib.nullcontext() as log, \
                deferred_stop(enabled=dist is None) as stop_requested:
            for k in range(start + 1, run.steps + 1):
                loss, record = step(k)
                if not math.isfinite(loss):
                    raise GmcError(f"loss became {loss} at step {k}; stopped. " + (
                        f"The last good checkpoint (step {saved}) is in {run.directory} (resume with --resume)"
                        if saved else "No checkpoint was written"))
                if tokens_per_step:
                    tokens = tokens_per_step * (k - start)
                    record["tok_per_s"] = round(tokens / (time.perf_counter() - started), 1)
                    record["tok_per_cpu_s"] = round(tokens / max(time.process_time() - cpu_started, 1e-9), 1)
                if not main:
                    continue
                log.write(json.dumps(record) + "\n")
                bar.update(1)
                bar.set_postfix(**postfix(record))
                stopping = bool(stop_requested) and k < run.steps  # a whole step is done: keep it
                # the last step is checkpointed too: the checkpoint outlives a failed artifact write
                if stopping or k % run.checkpoint_every == 0 or k == run.steps:
                    log.flush()
                    _save_state(run.directory, run.identity, module, optimizer, k)
                    saved = k
                    if on_checkpoint is not None:
                        on_checkpoint(k)
                if stopping:
                    bar.close()
                    raise Interrupted(f"checkpoint at step {k} in {run.directory}; continue with --resume",
                                      stop_requested[0])
    except KeyboardInterrupt:
        # Stopped mid-step (a second signal, or a distributed run): this step's update may be partly
        # applied, so nothing is saved; the last checkpoint stays valid.
        bar.close()
        raise Interrupted(f"stopped mid-step; the checkpoint of step {saved} in {run.directory} stays; continue "
                          f"with --resume" if saved else "stopped mid-step before the first checkpoint",
                          stop_requested[-1] if stop_requested else None) from None
    bar.close()


@contextlib.contextmanager
def deferred_stop(enabled: bool):
    """While training, SIGINT and SIGTERM only set a flag (the yielded list gets the signal number),
    read at the end of each step, so a checkpoint always holds whole steps; a second signal stops at
    once. Signals the process ignores (SIGINT in a background job) stay ignored. Off in distributed
    runs, whose ranks must stop at the same step, and outside the main thread."""
    requested: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def handler(signum, frame):
        requested.append(signum)  # the last one decides the exit code (two SIGTERMs: 143)
        if len(requested) > 1:
            raise KeyboardInterrupt

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _save_state(ckpt_dir: Path, identity: dict, module, optimizer, step: int) -> None:
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
