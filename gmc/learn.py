"""GroupMask mask learning: hypernetwork selectors trained by self-distillation under a budget.

Each step (DESIGN.md sections 2-5):
    teacher = graph(batch) with selectors off, no_grad          # the dense model
    logits  = hypernetwork()                                     # per target [G_out, G_in]
    B       = straight-through Gumbel-Sigmoid(logits)            # hard 0/1 forward
    student = graph(batch) with selectors B
    loss    = CE(softmax(teacher), log_softmax(student))         # chunked over tokens
            + lambda * |log(r / r_t)|                            # r = kept fraction of hard B
Only hypernetwork parameters receive gradients; the pretrained weights are frozen.

Exact resume: the batch of step ``k`` and its Gumbel noise are functions of ``(seed, k)`` alone,
and a checkpoint holds the hypernetwork, the optimizer and the step, so a run resumed from any
checkpoint reproduces the uninterrupted run bit for bit (same machine, same thread count).
Checkpoints are written atomically (temp file + rename); Ctrl-C writes one before exiting. The
last step is checkpointed too, and the caller deletes the checkpoint (``remove_checkpoint``) only
after the artifact is written, so a failed write loses nothing: ``--resume`` re-exports it.
Checkpoints load with ``weights_only=True``: a crafted ``state.pt`` cannot run code.

Data parallel (``dist`` given, see ``gmc.distributed``): the step is the same function, with each
rank running its slice of the global batch; the only collective is one all-reduce of the KD
gradient with respect to the selector logits (plus the KD value), after which every rank
backpropagates the identical gradient through its replica of the mask source. One process is the
``W = 1`` case of the same code.
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
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from tqdm.auto import tqdm

from gmc.artifact import atomic_write_bytes
from gmc.budget import BUDGETS, scheduled_sparsity, topk_keep, topk_selectors
from gmc.errors import GmcError, Interrupted
from gmc.groups import global_sparsity, layer_sparsity
from gmc.hypernet import HEADS, DirectLogits, HyperNetwork, export_selectors, parameter_count, relaxed_selectors
from gmc.outputs import output_path
from gmc.passes.find_targets import Target
from gmc.prior import MaskPrior, check_init
from gmc.selector import GroupSelector, selector_modules

if TYPE_CHECKING:
    from gmc.distributed import Dist

LEARNED_ALLOCATIONS = ("adaptive", "uniform")
STATE_FILE = "state.pt"
LOG_FILE = "train_log.jsonl"
EXPORT_TOLERANCE = 0.005  # exported global sparsity must be within 0.5 point of the target
LANDING = 0.1  # --budget schedule: the last tenth of the steps holds the exact top-k budget
UNTRAINED_GAP = 0.05  # warn when training stopped this far short of the target sparsity


# Named sets of learning defaults (``--recipe``); gmc's own defaults are LearnConfig's.
RECIPES = {
    "paper": {"steps": 40000, "lr": 1e-3, "lam": 16.0, "budget": "penalty", "init": "none"},
}


@dataclass
class LearnConfig:
    steps: int = 40000
    batch_size: int = 1
    lr: float = 3e-3  # measured with lambda 64 (docs/learning.md); the paper's 1e-3: --recipe paper
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.999
    lam: float = 64.0  # budget weight (schedule, penalty); the paper's 16 reaches no budget in a CPU-sized run
    budget: str = "schedule"  # gmc.budget: schedule | topk | penalty (the paper's)
    ramp: float = 0.2  # schedule/topk: fraction of the steps over which the target sparsity ramps up
    init: str = "none"  # gmc.prior: none | magnitude | wanda | sparsegpt
    temperature: float = 0.4
    offset: float = 3.0
    noise: bool = False  # measured: noise-free straight-through reaches the budget faster (docs/learning.md)
    head: str = "full"
    rank: int = 16
    checkpoint_every: int = 1000
    checkpoint_dir: Optional[str] = None  # None: "<output>.ckpt"
    resume: bool = False
    kd_chunk_tokens: int = 512
    optim_8bit: bool = False
    progress: bool = True
    grad_checkpointing: bool = False  # torchrun only: recompute decoder layers in backward
    fsdp_offload: bool = False  # torchrun on CUDA only: frozen weight shards live in host memory

    def __post_init__(self):
        for name in ("steps", "batch_size", "checkpoint_every", "rank", "kd_chunk_tokens"):
            if getattr(self, name) < 1:
                raise GmcError(f"bad --{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        for name in ("lr", "temperature", "lam"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise GmcError(f"bad --{name} {getattr(self, name)}: must be positive and finite")
        if self.checkpoint_dir is not None:
            self.checkpoint_dir = str(output_path(self.checkpoint_dir))
        if self.budget not in BUDGETS:
            raise GmcError(f"bad --budget {self.budget!r}: expected one of {', '.join(BUDGETS)}")
        if not 0.0 <= self.ramp <= 1.0:
            raise GmcError(f"bad --ramp {self.ramp}: must be a fraction of the steps in [0, 1]")
        check_init(self.init)
        if self.head not in HEADS:
            raise GmcError(f"bad --head {self.head!r}: expected one of {', '.join(HEADS)}")


@dataclass
class LearnResult:
    masks: dict[str, torch.Tensor]
    files: list[tuple[str, bytes]]  # written into the artifact directory
    manifest: dict = field(default_factory=dict)
    # the run's checkpoint, kept until the caller has written the artifact (None on other ranks)
    checkpoint_dir: Optional[Path] = None


def checkpoint_path(config) -> Path:
    """Where the learned run of ``config`` (a PruneConfig) checkpoints: ``--checkpoint-dir`` or
    ``OUTPUT.ckpt`` next to the normalised output (``-o out/`` and ``-o out`` share ``out.ckpt``)."""
    if config.learn.checkpoint_dir:
        return output_path(config.learn.checkpoint_dir)
    return output_path(f"{output_path(config.output)}.ckpt")


def learn_masks(gm, targets: list[Target], config, blocks: torch.Tensor, fingerprint: str,
                selectors: Optional[dict[str, GroupSelector]] = None, dist: Optional["Dist"] = None,
                prior: Optional[MaskPrior] = None) -> LearnResult:
    """Train selectors for ``targets`` of ``gm``; ``config`` is a PruneConfig.

    ``prior`` (``gmc.prior``): start the mask source from a one-shot method's group ranking; with
    ``--budget topk`` the final budget is then the prior mask's own kept count, so the export of
    the untrained mask source is exactly the prior's mask.

    ``gm`` maps ``input_ids [B, S]`` to logits ``[B, S, V]``; ``selectors`` are its GroupSelectors
    by target name (default: the call_module nodes of a graph with selectors inserted). With
    ``dist`` this process is one data-parallel rank: rank 0 alone logs and writes checkpoints, and
    every rank returns the same masks.
    """
    learn: LearnConfig = config.learn
    pattern, shapes = config.pattern, {t.name: t.shape for t in targets}
    names = [t.name for t in targets]
    selectors = selector_modules(gm) if selectors is None else selectors
    main = dist is None or dist.main
    device = dist.device if dist is not None else next(iter(gm.parameters())).device
    if dist is None and (learn.grad_checkpointing or learn.fsdp_offload):
        raise GmcError("--grad-checkpointing and --fsdp-offload apply to the sharded model of a torchrun "
                       "launch (use torchrun --nproc-per-node 1 for a single device)")
    if learn.batch_size % (dist.world_size if dist else 1):
        raise GmcError(f"world size {dist.world_size} does not divide --batch-size {learn.batch_size}")
    torch.manual_seed(config.seed)
    grids = [pattern.grid(t.shape) for t in targets]
    prior_logits = None if prior is None else [prior.logits[n] for n in names]
    if prior_logits is not None and learn.budget != "topk":  # kept iff logit + offset > 0
        prior_logits = [p - learn.offset for p in prior_logits]
    if config.method == "direct":
        mask_source = DirectLogits(grids, seed=config.seed, prior=prior_logits)
    else:
        mask_source = HyperNetwork(grids, head=learn.head, rank=learn.rank, seed=config.seed, prior=prior_logits)
    mask_source.to(device)
    sizes = [pattern.group_sizes(t.shape).to(device, torch.float32) for t in targets]
    total = float(sum(s.sum() for s in sizes))
    budget = Budget(names, sizes, total, config.sparsity, config.allocation,
                    None if prior is None else prior.kept_params(pattern, shapes))
    optimizer = _optimizer(mask_source, learn, device)
    ckpt_dir = checkpoint_path(config)
    identity = _run_identity(config, fingerprint, names, blocks)
    log_path = ckpt_dir / LOG_FILE

    def prepare():  # on rank 0: the state to resume from (or None), the log cut to its step
        state = _load_state(ckpt_dir, identity, learn.steps) if learn.resume else None
        if not learn.resume and (ckpt_dir / STATE_FILE).exists():
            raise GmcError(f"{ckpt_dir} holds a checkpoint of an earlier run: pass --resume to continue it, "
                           f"or delete it to start over")
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _truncate_log(log_path, 0 if state is None else int(state["step"]))
        return state

    state = prepare() if dist is None else dist.on_main(prepare)  # the state reaches every rank
    start = 0 if state is None else _apply_state(state, mask_source, optimizer)

    n_params = parameter_count(mask_source)
    if learn.progress and main:
        tqdm.write(f"gmc: {type(mask_source).__name__} ({learn.head if config.method != 'direct' else 'free logits'}) "
                   f"with {n_params:,} trainable parameters for {len(names)} targets")
    bar = tqdm(total=learn.steps, initial=start, desc="groupmask", unit="step", disable=not (learn.progress and main))
    step, started = start, time.perf_counter()
    saved = start  # the step of the checkpoint on disk (0: none)
    stop_requested: list[int] = []  # signals received while training (rebound by _deferred_stop)
    try:
        with open(log_path, "a") if main else contextlib.nullcontext() as log, \
                _deferred_stop(enabled=dist is None) as stop_requested:
            for step in range(start + 1, learn.steps + 1):
                record = _train_step(gm, selectors, mask_source, optimizer, names, budget, config,
                                     blocks, step, device, dist)
                if not math.isfinite(record["loss"]):
                    raise GmcError(f"loss became {record['loss']} at step {step}; stopped. " + (
                        f"The last good checkpoint (step {saved}) is in {ckpt_dir} (resume with --resume)" if saved
                        else "No checkpoint was written"))
                tokens = learn.batch_size * blocks.shape[1]
                record["tok_per_s"] = round(tokens * (step - start) / (time.perf_counter() - started), 1)
                if not main:
                    continue
                log.write(json.dumps(record) + "\n")
                bar.update(1)
                bar.set_postfix(kd=f"{record['kd']:.4f}", reg=f"{record['reg']:.3f}",
                                sparsity=f"{record['sparsity']:.3f}", tok_s=record["tok_per_s"])
                stopping = bool(stop_requested) and step < learn.steps  # a whole step is done: keep it
                # the last step is checkpointed too: the checkpoint outlives a failed artifact write
                if stopping or step % learn.checkpoint_every == 0 or step == learn.steps:
                    log.flush()
                    _save_state(ckpt_dir, identity, mask_source, optimizer, step)
                    saved = step
                if stopping:
                    bar.close()
                    raise Interrupted(f"checkpoint at step {step} in {ckpt_dir}; continue with --resume",
                                      stop_requested[0])
    except KeyboardInterrupt:
        # Stopped mid-step (a second signal, or a distributed run): this step's update may be partly
        # applied, so nothing is saved; the last checkpoint stays valid.
        bar.close()
        raise Interrupted(f"stopped mid-step; the checkpoint of step {saved} in {ckpt_dir} stays; continue with "
                          f"--resume" if saved else "stopped mid-step before the first checkpoint",
                          stop_requested[-1] if stop_requested else None) from None
    bar.close()

    with torch.no_grad():
        logits = {n: l.detach().float().cpu() for n, l in zip(names, mask_source())}
    masks, moved, trained = _export(logits, config, shapes, budget)
    if main and config.sparsity - trained > UNTRAINED_GAP:
        warnings.warn(f"training ended at {trained:.1%} sparsity for a {config.sparsity:.0%} target: the export "
                      f"threshold chose the remaining groups from logits still being learned, so the masks are "
                      f"close to arbitrary there; train longer (--steps)",
                      RuntimeWarning, stacklevel=2)
    buffer = io.BytesIO()
    torch.save({"state_dict": mask_source.state_dict(), "names": names, "grids": grids,
                "head": learn.head, "method": config.method}, buffer)
    files = [("hypernetwork.pt", buffer.getvalue()), (LOG_FILE, log_path.read_bytes())] if main else []
    manifest = {
        "training": {**asdict(learn), "trainable_parameters": n_params,
                     "wall_seconds": round(time.perf_counter() - started, 1),
                     "world_size": dist.world_size if dist else 1},
        "export_thresholds_moved": moved,
        "trained_sparsity": round(trained, 6),  # noise-free selectors before any threshold was moved
    }
    return LearnResult(masks, files, manifest, ckpt_dir if main else None)


class Budget:
    """The parameters each step's selectors keep (``gmc.budget``)."""

    def __init__(self, names, sizes, total, sparsity, allocation, final_keep: Optional[float]):
        self.names, self.sizes, self.total, self.sparsity = names, sizes, total, sparsity
        self.per_target = allocation == "uniform"
        # with a prior, its mask's own count (within a group per target of the target)
        self.final_keep = final_keep if final_keep is not None else (1.0 - sparsity) * total

    def keep_params(self, sparsity: float):
        """Parameters to keep at a scheduled ``sparsity``: one number, or one per target (uniform)."""
        fraction = (1.0 - sparsity) / (1.0 - self.sparsity) * self.final_keep / self.total
        if self.per_target:
            return [fraction * float(s.sum()) for s in self.sizes]
        return fraction * self.total


def _train_step(gm, selectors, mask_source, optimizer, names, budget, config, blocks, step, device,
                dist) -> dict:
    learn: LearnConfig = config.learn
    rank, world = (dist.rank, dist.world_size) if dist else (0, 1)
    indices = batch_indices(step, learn.batch_size, blocks.shape[0], config.seed)
    batch = blocks[indices.view(world, -1)[rank]].to(device)  # this rank's contiguous slice [B/W, S]
    with torch.no_grad(), _dense(selectors), _autocast(device):
        teacher = gm(batch)  # [B/W, S, V]
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step) if learn.noise else None
    logits = mask_source()  # identical on every rank (replicated mask source)
    leaves = [l.detach().requires_grad_() for l in logits]  # backward stops here, then is all-reduced
    sizes, total = budget.sizes, budget.total
    scheduled = scheduled_sparsity(step, learn.steps, config.sparsity, learn.ramp if learn.budget != "penalty" else 0.0)
    if learn.budget == "topk" or (learn.budget == "schedule" and step > (1.0 - LANDING) * learn.steps):
        noisy = leaves if generator is None else [l + _logistic(l, generator) for l in leaves]
        hard = topk_selectors(noisy, sizes, budget.keep_params(scheduled), budget.per_target, learn.temperature)
        kept = [(h * s).sum() for h, s in zip(hard, sizes)]
        reg = torch.zeros((), device=leaves[0].device)
        reg_grads = [torch.zeros_like(l) for l in leaves]
    else:
        hard = [relaxed_selectors(l, learn.temperature, learn.offset, generator) for l in leaves]
        kept = [(h * s).sum() for h, s in zip(hard, sizes)]
        target_kept = 1.0 - scheduled
        if config.allocation == "uniform":
            reg = torch.stack([(k / s.sum() / target_kept).log().abs() for k, s in zip(kept, sizes)]).mean()
        else:
            reg = (torch.stack(kept).sum() / total / target_kept).log().abs()
        # the regulariser sees the global sparsity and is counted once: every rank has the same value
        reg_grads = torch.autograd.grad(learn.lam * reg, leaves, retain_graph=True)
    for name, value in zip(names, hard):
        selectors[name].selectors = value
    with _autocast(device):
        student = gm(batch)  # [B/W, S, V]
    # mean over this rank's tokens, weighted by its share of the global tokens
    share = batch.numel() / (indices.numel() * blocks.shape[1])
    kd = soft_cross_entropy(student, teacher, learn.kd_chunk_tokens) * share
    kd.backward()
    for selector in selectors.values():
        selector.selectors = None  # drop the autograd graph held by the selectors
    # [sum_l G_l + 1]: dKD/dlogits of every target, then KD itself
    flat = torch.cat([leaf.grad.reshape(-1) for leaf in leaves] + [kd.detach().reshape(1).to(leaves[0].dtype)])
    if dist is not None:
        dist.all_reduce_(flat)
    kd_total = flat[-1]
    loss = kd_total + learn.lam * reg.detach()
    optimizer.zero_grad(set_to_none=True)
    if torch.isfinite(loss):
        kd_grads = flat[:-1].split([leaf.numel() for leaf in leaves])
        torch.autograd.backward(logits, [(g.view_as(r) + r) for g, r in zip(kd_grads, reg_grads)])
        optimizer.step()
    sparsity = 1.0 - float(torch.stack(kept).sum().detach()) / total
    return {"step": step, "loss": loss.item(), "kd": kd_total.item(), "reg": reg.item(), "sparsity": round(sparsity, 6)}


@contextlib.contextmanager
def _dense(selectors: dict[str, GroupSelector]):
    """Run the model with every selector off: the self-distillation teacher."""
    for selector in selectors.values():
        selector.enabled = False
    try:
        yield
    finally:
        for selector in selectors.values():
            selector.enabled = True


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


def _logistic(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Logistic noise (the difference of two Gumbel samples) shaped like ``like``."""
    u1, u2 = torch.rand((2, *like.shape), generator=generator).to(like.device, like.dtype)
    return -torch.log(-torch.log(u1 + 1e-20) + 1e-20) + torch.log(-torch.log(u2 + 1e-20) + 1e-20)


def _export(logits: dict, config, shapes: dict, budget: "Budget") -> tuple[dict, dict, float]:
    """Noise-free selectors at the target.

    ``topk``: the ranking of the final logits at the full budget, which is the last training mask
    (once the ramp is over); nothing is moved. ``penalty``: keep iff ``l + offset > 0``; where
    that misses the budget, move one threshold on the logits.

    Adaptive: one global threshold if the global sparsity misses by more than 0.5 point.
    Uniform: a threshold per target that misses its own budget by more than 1 point.
    Returns the masks, the thresholds moved (empty when none was) and the global sparsity of the
    noise-free selectors before any move (how far training itself got).
    """
    pattern, offset, sparsity = config.pattern, config.learn.offset, config.sparsity
    if config.learn.budget in ("topk", "schedule"):
        sizes = [s.cpu() for s in budget.sizes]
        keeps, _ = topk_keep(list(logits.values()), sizes, budget.keep_params(sparsity), budget.per_target)
        masks = dict(zip(logits, keeps))
        return masks, {}, global_sparsity(pattern, masks, shapes)
    masks = {n: export_selectors(l, offset) for n, l in logits.items()}
    trained = global_sparsity(pattern, masks, shapes)
    moved = {}
    if config.allocation == "uniform":
        for name, value in logits.items():
            if abs(layer_sparsity(pattern, masks[name], shapes[name]) - sparsity) > 2 * EXPORT_TOLERANCE:
                new, moved[name] = _budget_threshold({name: value}, pattern, shapes, sparsity, offset)
                masks.update(new)
    elif abs(trained - sparsity) > EXPORT_TOLERANCE:
        masks, moved["global"] = _budget_threshold(logits, pattern, shapes, sparsity, offset)
    return masks, moved, trained


def _budget_threshold(logits: dict, pattern, shapes: dict, sparsity: float, offset: float):
    """Keep the highest-logit groups of ``logits`` until ``1 - sparsity`` of their parameters."""
    flat = torch.cat([l.reshape(-1) + offset for l in logits.values()])
    size = torch.cat([pattern.group_sizes(shapes[n]).reshape(-1).double() for n in logits])
    order = flat.argsort(descending=True, stable=True)
    budget = (1.0 - sparsity) * float(size.sum())
    count = int((size[order].cumsum(0) - budget).abs().argmin()) + 1
    threshold = float(flat[order[count - 1]])
    return {n: _keep_at_least(l + offset >= threshold, l) for n, l in logits.items()}, threshold


def _keep_at_least(keep: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    if not bool(keep.any()):
        keep = keep.clone()
        keep.view(-1)[logits.argmax()] = True
    return keep


def _optimizer(module, learn: LearnConfig, device) -> torch.optim.Optimizer:
    return adamw(module.parameters(), device, learn.optim_8bit, lr=learn.lr, betas=(learn.beta1, learn.beta2),
                 weight_decay=learn.weight_decay)


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
    return torch.optim.AdamW(params, **kwargs)


def _autocast(device):
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _run_identity(config, fingerprint: str, names: list[str], blocks: torch.Tensor) -> dict:
    """What must be equal for a checkpoint to be resumed by this run."""
    learn = config.learn
    return {
        "model_fingerprint": fingerprint, "method": config.method, "group": str(config.pattern),
        "sparsity": config.sparsity, "allocation": config.allocation, "seed": config.seed,
        "targets": len(names), "target_names": list(names),
        "blocks": list(blocks.shape), "blocks_sum": int(blocks.sum()),
        "batch_size": learn.batch_size, "lr": learn.lr, "lam": learn.lam, "head": learn.head,
        "rank": learn.rank, "noise": learn.noise, "temperature": learn.temperature,
        "budget": learn.budget, "ramp": learn.ramp, "init": learn.init,
    }


@contextlib.contextmanager
def _deferred_stop(enabled: bool):
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


def _apply_state(state: dict, module, optimizer) -> int:
    module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


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
    for name in (STATE_FILE, LOG_FILE):
        (ckpt_dir / name).unlink(missing_ok=True)
    try:
        os.rmdir(ckpt_dir)
    except OSError:
        pass
