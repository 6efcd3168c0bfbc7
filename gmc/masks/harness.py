"""The step loop of a resumable run: what mask learning (``gmc.masks.training``) and weight recovery
(``gmc.masks.recover``) share.

Both are self-distillation runs of ``steps`` optimizer steps over calibration blocks:

    start = resume(run, module, optimizer)        # 0, or the step of run's checkpoint (state loaded)
    run_steps(run, step, start, module, optimizer, postfix)
        each step k:  loss, record = step(k)      # the caller's update, on batch_indices(k)
                      record -> LOG_FILE, progress bar
                      every checkpoint_every steps, at the last one and on SIGINT/SIGTERM: STATE_FILE

The blocks of step ``k`` are ``batch_indices(k, ...)``, a function of ``(seed, k)`` alone, which is what
makes a resumed run exact (``gmc.masks.checkpoint``: what a checkpoint holds, resume, deletion). A first
SIGINT/SIGTERM finishes the step and checkpoints it; a second stops at once, keeping the last checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

import torch
from tqdm.auto import tqdm

from gmc.errors import GmcError, Interrupted
from gmc.masks.checkpoint import LOG_FILE, Run, save_state

if TYPE_CHECKING:
    from gmc.masks.distributed import Dist

RATE_KEYS = ("tok_per_s", "tok_per_cpu_s")  # the log record's throughput: the host's, not the run's


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
                    save_state(run.directory, run.identity, module, optimizer, k)
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
