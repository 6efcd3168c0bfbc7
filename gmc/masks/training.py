"""A learned run (``--method groupmask | direct``): selectors trained by self-distillation under a budget.

Each step (docs/design.md sections 2-5):
    teacher = graph(batch) with selectors off, no_grad          # the dense model (gmc.masks.teacher:
                                                                 # its trunk cached per block)
    logits  = hypernetwork()                                     # per target [G_out, G_in]
    B       = straight-through Gumbel-Sigmoid(logits)            # hard 0/1 forward
    student = graph(batch) with selectors B
    loss    = CE(softmax(teacher), log_softmax(student))         # chunked over tokens
            + layer_kd * mean_l |h_l - h_l^T|^2 / |h_l^T|^2      # --layer-kd: chosen blocks' outputs
            + lambda * |log(r / r_t)|                            # r = kept fraction of hard B
Only hypernetwork parameters receive gradients; the pretrained weights are frozen. With
``learn_weights`` each target's student weight is ``W + delta`` (``delta`` zero at the start, its
own learning rate): the kept weights adapt to the masks while they are learned, the teacher stays
the pretrained model, and the export is ``(W + delta) * M`` (pruned entries exactly zero).

The run around the steps (data order, the log, signals; checkpoints and exact resume) is
``gmc.masks.harness``'s (``gmc.masks.checkpoint``'s), shared with weight recovery. A checkpoint resumes
only the same ``MaskTask`` trained with the same learning settings (``_identity``).

``learn`` is the run's ``gmc.masks.learn.LearnConfig`` (this module reads its fields and does not import
it: the config offers the mask sources' priors, and the table of sources runs this module).

Data parallel (``dist`` given, see ``gmc.masks.distributed``): the step is the same function, with each
rank running its slice of the global batch; the only collective is one all-reduce of the KD
gradient with respect to the selector logits (plus the KD value), after which every rank
backpropagates the identical gradient through its replica of the mask source. One process is the
``W = 1`` case of the same code.
"""
from __future__ import annotations

import io
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from tqdm.auto import tqdm

from gmc.errors import GmcError
from gmc.graph.selector import GroupSelector
from gmc.graph.taps import block_outputs, chosen_blocks, with_outputs
from gmc.graph.targets import Target
from gmc.groups import GroupSpec
from gmc.masks.budget import (
    LANDING,
    Budget,
    budget_threshold,
    last_ramp_step,
    scheduled_sparsity,
    topk_keep,
    topk_selectors,
)
from gmc.masks.checkpoint import LOG_FILE, Run, blocks_identity, resume
from gmc.masks.distill import hidden_distance, soft_cross_entropy
from gmc.masks.harness import batch_indices, run_steps
from gmc.masks.hypernet import (
    PAPER_OFFSET,
    DirectLogits,
    HyperNetwork,
    export_selectors,
    logistic_noise,
    parameter_count,
    relaxed_selectors,
)
from gmc.masks.prior import MaskPrior
from gmc.masks.recover import LearnedGraph, learned_weights
from gmc.masks.student import Student, adamw, autocast, compiles_step, lr_scale, resolve_precision
from gmc.masks.teacher import Teacher

if TYPE_CHECKING:
    from gmc.masks.distributed import Dist

EXPORT_TOLERANCE = 0.005  # exported global sparsity must be within 0.5 point of the target
UNTRAINED_GAP = 0.05  # warn when training stopped this far short of the target sparsity


@dataclass(frozen=True)
class MaskTask:
    """What a learned run makes, apart from how it learns (``LearnConfig``)."""

    method: str  # groupmask (the hypernetwork) | direct (free logits: the ablation)
    pattern: GroupSpec
    sparsity: float  # the global target
    allocation: str  # one of gmc.masks.budget.LEARNED_ALLOCATIONS
    seed: int
    fingerprint: str  # gmc.formats.artifact.model_fingerprint of the model the masks are for
    checkpoint_dir: Path  # gmc.masks.checkpoint.checkpoint_path


@dataclass
class LearnResult:
    masks: dict[str, torch.Tensor]
    files: list[tuple[str, bytes]]  # written into the artifact directory
    manifest: dict = field(default_factory=dict)
    # the run's checkpoint, kept until the caller has written the artifact (None on other ranks)
    checkpoint_dir: Optional[Path] = None
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # learn_weights: (W + delta) * M per target
    graph: Optional[LearnedGraph] = None  # what a recovery continues on (single process; None under torchrun)


class _Trained(torch.nn.Module):
    """What a checkpoint holds: the mask source and, with ``learn_weights``, the weight deltas."""

    def __init__(self, mask_source: torch.nn.Module, deltas: Optional[torch.nn.ParameterList]):
        super().__init__()
        self.mask_source = mask_source
        self.deltas = deltas


def learn_masks(gm, targets: list[Target], selectors: dict[str, GroupSelector], blocks: torch.Tensor, task: MaskTask,
                learn, dist: Optional["Dist"] = None, prior: Optional[MaskPrior] = None,
                recover_steps: int = 0) -> LearnResult:
    """Train selectors for ``targets`` of ``gm`` on the calibration ``blocks`` ``[n, S]``.

    ``recover_steps``: the recovery steps that will continue on the returned graph (``--recover-steps``);
    they count toward ``--compile-step auto``'s length.

    ``prior`` (``gmc.masks.prior``): start the mask source from a one-shot method's group ranking; with
    ``--budget topk`` the final budget is then the prior mask's own kept count, so the export of
    the untrained mask source is exactly the prior's mask.

    ``gm`` maps ``input_ids [B, S]`` to logits ``[B, S, V]``; ``selectors`` are its GroupSelectors
    by target name (``selector_modules`` of a graph with selectors inserted, or ``attach_selectors``'s). With
    ``dist`` this process is one data-parallel rank: rank 0 alone logs and writes checkpoints, and
    every rank returns the same masks.
    """
    _check_launch(learn, dist)
    names, shapes = [t.name for t in targets], {t.name: t.shape for t in targets}
    main = dist is None or dist.main
    device = dist.device if dist is not None else next(iter(gm.parameters())).device
    torch.manual_seed(task.seed)  # the mask source's initialisation
    grids = [task.pattern.grid(t.shape) for t in targets]
    mask_source = _mask_source(task, learn, grids, None if prior is None else [prior.logits[n] for n in names])
    mask_source.to(device)
    sizes = [task.pattern.group_sizes(t.shape).to(device, torch.float32) for t in targets]
    budget = Budget(names, sizes, task.sparsity, task.allocation,
                    None if prior is None else prior.kept_params(task.pattern, shapes))
    weights = {t.name: gm.get_parameter(t.node.args[1].target) for t in targets} if learn.learn_weights else {}
    deltas = torch.nn.ParameterList(torch.zeros(w.shape, dtype=torch.float32, device=device)
                                    for w in weights.values()) if weights else None
    trained = _Trained(mask_source, deltas)
    groups = [{"params": list(mask_source.parameters())}]
    if deltas is not None:
        groups.append({"params": list(deltas), "lr": learn.weight_lr, "weight_decay": 0.0})
    optimizer = adamw(groups, device, learn.optim_8bit, lr=learn.lr,
                      betas=(learn.beta1, learn.beta2), weight_decay=learn.weight_decay)
    precision = resolve_precision(learn.precision, device)
    compiled = compiles_step(learn, dist, recover_steps)
    run = Run(task.checkpoint_dir, _identity(task, learn, names, blocks, precision, compiled), learn.steps,
              learn.checkpoint_every, learn.resume, "groupmask", progress=learn.progress)
    start = resume(run, trained, optimizer, dist)
    for name, delta in zip(weights, deltas or []):
        selectors[name].delta = delta
    taps = layer_taps(gm, learn)
    teacher = Teacher(gm, blocks, device, learn.teacher_cache, precision, run.directory if main else None,
                      run.identity, progress=learn.progress and main, taps=taps)
    student = Student(with_outputs(gm, taps) if taps else gm, compiled)

    n_params = parameter_count(trained)  # the mask source, and the weight deltas if any
    if learn.progress and main:
        tqdm.write(f"gmc: {type(mask_source).__name__} ({learn.head if task.method != 'direct' else 'free logits'}) "
                   f"with {n_params:,} trainable parameters for {len(names)} targets; {precision} GEMMs, "
                   f"{'compiled step (the first step compiles it)' if compiled else 'eager step'}")
    started = time.perf_counter()

    def step(k: int) -> tuple[float, dict]:
        record = _train_step(student, selectors, mask_source, optimizer, budget, task, learn, precision, blocks,
                             teacher, k, device, dist)
        return record["loss"], record

    def save_teacher(k: int) -> None:  # the last step's checkpoint serves a re-export, which needs no teacher
        if k < learn.steps:
            teacher.save()

    try:
        run_steps(run, step, start, trained, optimizer, _postfix, dist,
                  tokens_per_step=learn.batch_size * blocks.shape[1], on_checkpoint=save_teacher)
    finally:
        for name in weights:
            selectors[name].delta = None

    with torch.no_grad():
        logits = {n: logit.detach().float().cpu() for n, logit in zip(names, mask_source())}
    masks, moved, reached = _export(logits, task, learn, budget)
    if main and task.sparsity - reached > UNTRAINED_GAP:
        warnings.warn(f"training ended at {reached:.1%} sparsity for a {task.sparsity:.0%} target: the export "
                      f"threshold chose the remaining groups from logits still being learned, so the masks are "
                      f"close to arbitrary there; train longer (--steps)",
                      RuntimeWarning, stacklevel=2)
    before_landing = _sparsity_before_landing(run, learn) if main else None
    if before_landing is not None and task.sparsity - before_landing > UNTRAINED_GAP:
        warnings.warn(f"the penalty reached {before_landing:.1%} sparsity for a {task.sparsity:.0%} target before "
                      f"the landing (the last {LANDING:.0%} of the steps), whose top-k dropped the rest at once; "
                      f"train longer (--steps) or start the logits closer to the threshold (--offset, "
                      f"{learn.offset:g} in this run)", RuntimeWarning, stacklevel=2)
    manifest = {
        "training": {**asdict(learn), "precision": precision, "compiled": compiled, "trainable_parameters": n_params,
                     "wall_seconds": round(time.perf_counter() - started, 1),
                     "world_size": dist.world_size if dist else 1},
        "export_thresholds_moved": moved,
        "trained_sparsity": round(reached, 6),  # noise-free selectors before any threshold was moved
        **({"sparsity_before_landing": before_landing} if before_landing is not None else {}),
    }
    files = _artifact_files(mask_source, names, grids, task, learn) if main else []
    graph = None if dist is not None else LearnedGraph(
        selectors, {t.name: gm.get_parameter(t.node.args[1].target) for t in targets}, student, teacher, precision,
        compiled)
    return LearnResult(masks, files, manifest, run.directory if main else None,
                       learned_weights(weights, deltas, masks, task.pattern), graph)


def _sparsity_before_landing(run: Run, learn) -> Optional[float]:
    """``--budget schedule``: the training sparsity of the last step before the top-k landing (from the
    training log, so a resumed run has it too); None for other budgets or a run all landing."""
    last = last_ramp_step(learn.steps)
    if learn.budget != "schedule" or last < 1:
        return None
    with open(run.directory / LOG_FILE) as log:
        records = [json.loads(line) for line in log]
    return next((record["sparsity"] for record in records if record["step"] == last), None)


def check_world_size(batch_size: int, world_size: int) -> None:
    """Each step's global batch is split evenly across the ranks of a data-parallel run."""
    if batch_size % world_size:
        raise GmcError(f"world size {world_size} does not divide --batch-size {batch_size}: the global batch is "
                       f"split evenly across ranks; use a multiple of {world_size}")


def layer_taps(gm, learn) -> list[str]:
    """The graph nodes whose values layer-wise distillation compares (none without ``--layer-kd``)."""
    if not learn.layer_kd:
        return []
    outputs = block_outputs(gm)
    return [outputs[i] for i in chosen_blocks(len(outputs), learn.layer_kd_every)]


def _check_launch(learn, dist: Optional["Dist"]) -> None:
    if dist is not None and learn.learn_weights:
        raise GmcError("--learn-weights runs in a single process: the weight deltas are not sharded under torchrun")
    if dist is not None and learn.layer_kd:
        raise GmcError("--layer-kd runs in a single process: the torchrun path trains the eager model, which has "
                       "no graph to read the decoder blocks' outputs from")
    if dist is None and (learn.grad_checkpointing or learn.fsdp_offload):
        raise GmcError("--grad-checkpointing and --fsdp-offload apply to the sharded model of a torchrun "
                       "launch (use torchrun --nproc-per-node 1 for a single device)")
    if dist is not None:
        check_world_size(learn.batch_size, dist.world_size)


def _mask_source(task: MaskTask, learn, grids: list, prior_logits: Optional[list]) -> torch.nn.Module:
    """The hypernetwork (``groupmask``) or free logits (``direct``), started from the prior if any."""
    if prior_logits is not None and learn.budget != "topk":  # kept iff logit + offset > 0
        prior_logits = [p - learn.offset for p in prior_logits]
    if task.method == "direct":
        return DirectLogits(grids, seed=task.seed, prior=prior_logits)
    return HyperNetwork(grids, head=learn.head, rank=learn.rank, seed=task.seed, prior=prior_logits)


def _identity(task: MaskTask, learn, names: list[str], blocks: torch.Tensor, precision: str,
              compiled: bool) -> dict:
    """What must be equal for a checkpoint to be resumed by this run."""
    return {
        "model_fingerprint": task.fingerprint, "method": task.method, "group": str(task.pattern),
        "sparsity": task.sparsity, "allocation": task.allocation, "seed": task.seed,
        "targets": len(names), "target_names": list(names), **blocks_identity(blocks),
        "batch_size": learn.batch_size, "lr": learn.lr, "lam": learn.lam, "head": learn.head,
        "rank": learn.rank, "noise": learn.noise, "temperature": learn.temperature,
        "budget": learn.budget, "ramp": learn.ramp, "init": learn.init,
        "teacher": "cached" if learn.teacher_cache else "live",
        "precision": precision, "compiled": compiled,
        "learn_weights": learn.learn_weights, **({"weight_lr": learn.weight_lr} if learn.learn_weights else {}),
        **({"layer_kd": learn.layer_kd, "layer_kd_every": learn.layer_kd_every} if learn.layer_kd else {}),
        **({"lr_decay": learn.lr_decay} if learn.lr_decay != "none" else {}),
        # runs at the paper's offset carried none (resumable as they were)
        **({"offset": learn.offset} if learn.offset != PAPER_OFFSET else {}),
    }


def _artifact_files(mask_source, names: list[str], grids: list, task: MaskTask, learn) -> list:
    """The trained mask source and the training log, for the artifact directory."""
    buffer = io.BytesIO()
    torch.save({"state_dict": mask_source.state_dict(), "names": names, "grids": grids,
                "head": learn.head, "method": task.method}, buffer)
    return [("hypernetwork.pt", buffer.getvalue()), (LOG_FILE, (task.checkpoint_dir / LOG_FILE).read_bytes())]


def _postfix(record: dict) -> dict:
    layer = {"layer": f"{record['layer']:.4f}"} if "layer" in record else {}
    return dict(kd=f"{record['kd']:.4f}", **layer, reg=f"{record['reg']:.3f}", sparsity=f"{record['sparsity']:.3f}",
                tok_s=record["tok_per_s"], tok_cpu_s=record["tok_per_cpu_s"])


def _train_step(student_model, selectors, mask_source, optimizer, budget: Budget, task: MaskTask, learn,
                precision: str, blocks, teacher: Teacher, step: int, device, dist) -> dict:
    rank, world = (dist.rank, dist.world_size) if dist else (0, 1)
    indices = batch_indices(step, learn.batch_size, blocks.shape[0], task.seed)
    mine = indices.view(world, -1)[rank]  # this rank's contiguous slice of the global batch
    batch = blocks[mine].to(device)  # [B/W, S]
    dense, dense_taps = teacher.outputs(mine, batch)  # [B/W, S, V]; with --layer-kd, [B/W, S, d] per tap
    optimizer.zero_grad(set_to_none=True)  # before the student's backward, which reaches the weight deltas
    logits = mask_source()  # identical on every rank (replicated mask source)
    leaves = [logit.detach().requires_grad_() for logit in logits]  # backward stops here, then is all-reduced
    hard, kept, reg, reg_grads = _hard_selectors(leaves, step, budget, task, learn)
    for name, value in zip(budget.names, hard):
        selectors[name].selectors = value
    with autocast(device, precision):
        student = student_model(batch)  # [B/W, S, V], or (logits, *taps) with --layer-kd
    student, student_taps = (student[0], student[1:]) if dense_taps else (student, ())
    # mean over this rank's tokens, weighted by its share of the global tokens
    share = batch.numel() / (indices.numel() * blocks.shape[1])
    kd = soft_cross_entropy(student, dense, learn.kd_chunk_tokens) * share
    layer = hidden_distance(list(student_taps), dense_taps) * share if dense_taps else torch.zeros_like(kd)
    (kd + learn.layer_kd * layer).backward()  # layer: zero without --layer-kd
    for selector in selectors.values():
        selector.selectors = None  # drop the autograd graph held by the selectors
    # [sum_l G_l + 2]: d(distillation)/dlogits of every target, then the logit KD and the layer loss
    values = torch.stack([kd.detach(), layer.detach()]).to(leaves[0].dtype)
    flat = torch.cat([leaf.grad.reshape(-1) for leaf in leaves] + [values])
    if dist is not None:
        dist.all_reduce_(flat)
    kd_total, layer_total = flat[-2], flat[-1]
    loss = kd_total + learn.layer_kd * layer_total + learn.lam * reg.detach()
    if torch.isfinite(loss):
        kd_grads = flat[:-2].split([leaf.numel() for leaf in leaves])
        torch.autograd.backward(logits, [(g.view_as(r) + r) for g, r in zip(kd_grads, reg_grads)])
        scale = lr_scale(step, learn.steps, learn.lr_decay)
        for group, rate in zip(optimizer.param_groups, (learn.lr, learn.weight_lr)):  # mask source, deltas
            group["lr"] = rate * scale
        optimizer.step()
    sparsity = 1.0 - float(torch.stack(kept).sum().detach()) / budget.total
    extra = {"layer": layer_total.item()} if dense_taps else {}
    return {"step": step, "loss": loss.item(), "kd": kd_total.item(), **extra, "reg": reg.item(),
            "sparsity": round(sparsity, 6)}


def _hard_selectors(leaves: list[torch.Tensor], step: int, budget: Budget, task: MaskTask, learn):
    """This step's hard selectors, the parameters each keeps, the budget regulariser and its
    gradient with respect to ``leaves`` (the selector logits)."""
    generator = torch.Generator().manual_seed(task.seed * 1_000_003 + step) if learn.noise else None
    sizes, total = budget.sizes, budget.total
    scheduled = scheduled_sparsity(step, learn.steps, task.sparsity, learn.ramp if learn.budget != "penalty" else 0.0)
    if learn.budget == "topk" or (learn.budget == "schedule" and step > last_ramp_step(learn.steps)):
        noisy = leaves if generator is None else [leaf + logistic_noise(leaf, generator) for leaf in leaves]
        hard = topk_selectors(noisy, sizes, budget.keep_params(scheduled), budget.per_target, learn.temperature)
        kept = budget.kept(hard)
        return hard, kept, torch.zeros((), device=leaves[0].device), [torch.zeros_like(leaf) for leaf in leaves]
    hard = [relaxed_selectors(leaf, learn.temperature, learn.offset, generator) for leaf in leaves]
    kept = budget.kept(hard)
    target_kept = 1.0 - scheduled
    if budget.per_target:
        reg = torch.stack([(k / s.sum() / target_kept).log().abs() for k, s in zip(kept, sizes)]).mean()
    else:
        reg = (torch.stack(kept).sum() / total / target_kept).log().abs()
    # the regulariser sees the global sparsity and is counted once: every rank has the same value
    return hard, kept, reg, torch.autograd.grad(learn.lam * reg, leaves, retain_graph=True)


def _export(logits: dict, task: MaskTask, learn, budget: Budget) -> tuple[dict, dict, float]:
    """Noise-free selectors at the target.

    ``topk``: the ranking of the final logits at the full budget, which is the last training mask
    (once the ramp is over); nothing is moved. ``penalty``: keep iff ``l + offset > 0``; where
    that misses the budget, move one threshold on the logits.

    Adaptive: one global threshold if the global sparsity misses by more than 0.5 point.
    Uniform: a threshold per target that misses its own budget by more than 1 point.
    Returns the masks, the thresholds moved (empty when none was) and the global sparsity of the
    noise-free selectors before any move (how far training itself got).
    """
    offset, sparsity = learn.offset, task.sparsity
    sizes = [s.cpu() for s in budget.sizes]
    if learn.budget in ("topk", "schedule"):
        keeps, _ = topk_keep(list(logits.values()), sizes, budget.keep_params(sparsity), budget.per_target)
        return dict(zip(logits, keeps)), {}, budget.sparsity_of(keeps)
    masks = {n: export_selectors(logit, offset) for n, logit in logits.items()}
    trained = budget.sparsity_of(list(masks.values()))
    moved = {}
    if budget.per_target:
        for index, (name, value) in enumerate(logits.items()):
            if abs(budget.target_sparsity(index, masks[name]) - sparsity) > 2 * EXPORT_TOLERANCE:
                new, moved[name] = budget_threshold({name: value}, [sizes[index]], sparsity, offset)
                masks.update(new)
    elif abs(trained - sparsity) > EXPORT_TOLERANCE:
        masks, moved["global"] = budget_threshold(logits, sizes, sparsity, offset)
    return masks, moved, trained
