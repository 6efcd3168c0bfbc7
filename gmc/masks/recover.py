"""Weight recovery: the kept weights of the target linears tuned by self-distillation.

    masks (fixed) + dense model -> student = the model with the masks folded in
    each step k:  batch_k = blocks[batch_indices(k)]
                  teacher = dense model(batch_k)                      frozen copy, no_grad
                  loss    = CE(softmax(teacher), log_softmax(student(batch_k)))   chunked, as learning
                  grad(W) *= M;  AdamW step;  W *= M                 pruned entries stay exactly 0
Only the target linears' weights train (biases, norms, embeddings and lm_head stay frozen), so
the result is a ``weights.safetensors`` of the same targets, and the artifact it goes into is
lowered, evaluated and folded like any other (``weights_updated: true``).

Why: SparseGPT beats a frozen-weight mask because it *moves* the kept weights; layer-wise OBS
toward the pruned model's own inputs undoes errors that cancel across layers (docs/sparsegpt.md),
while distillation of the whole model's output keeps that cancellation and fits the rest.

The run around the steps (data order, the log, signals; checkpoints and exact resume) is
``gmc.masks.harness``'s (``gmc.masks.checkpoint``'s), as for mask learning: a checkpoint holds the trained
weights, AdamW's state and the step, and a resumed recovery reproduces the uninterrupted one bit for bit.
Memory (docs/scaling.md): the dense teacher copy, the student, gradients of the targets and two
AdamW moments. ``optim_8bit`` (bitsandbytes, CUDA) and ``grad_checkpointing`` (HF's decoder-layer
recomputation) make a 7B model fit one 80 GB GPU in bf16.

After a learned run (``gmc prune --recover-steps`` with ``--method groupmask | direct``) the recovery
continues on that run's own graph instead (``LearnedGraph``): its selectors hold the landed masks, a
trained ``delta`` per target is the change of the kept weights (the student's weight is ``W + delta``,
the teacher's stays ``W``), the teacher is the run's cached one (most blocks' trunk already computed)
and the student its compiled step at its precision. Same loss, same data order, same AdamW update of
the kept weights; at bf16, compiled, the step costs 2.1x fewer CPU-seconds than the eager one
(bundled SmolLM2, 256 tokens, 2 cores: record ``recovery-step``, bench/bench_learn_step.py).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from gmc.config import (
    base_model_option,
    check_at_least,
    check_positive,
    check_seq_len,
    device_option,
    dtype_option,
    option,
    output_option,
    overwrite_option,
    seed_option,
    trust_remote_code_option,
)
from gmc.errors import GmcError
from gmc.graph.selector import masked_weight
from gmc.groups import Pattern
from gmc.inputs.calib import calib_option, nsamples_option, seq_len_option
from gmc.masks.checkpoint import LOG_FILE, Run, blocks_identity, checkpoint_path, remove_checkpoint, resume
from gmc.masks.distill import soft_cross_entropy
from gmc.masks.harness import batch_indices, run_steps
from gmc.masks.student import adamw, autocast

if TYPE_CHECKING:
    from gmc.graph.selector import GroupSelector
    from gmc.masks.student import Student
    from gmc.masks.teacher import Teacher

RECOVER_LOG = "recover_log.jsonl"  # the recovery's loss log, inside the artifact
RECOVER_SUFFIX = ".recover-ckpt"  # the recovery's checkpoint directory: OUTPUT.recover-ckpt


@dataclass
class RecoverConfig:
    steps: int = option(200, "Distillation steps.")
    # AdamW on the kept weights; docs/quality.md's recovery rows measure this default
    lr: float = option(1e-4, "Learning rate (AdamW) of the kept weights.")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    batch_size: int = option(1, "Sequences per step.")
    checkpoint_every: int = option(100, "Steps between checkpoints.")
    checkpoint_dir: Optional[str] = option(None, "Where checkpoints go [default: OUTPUT.recover-ckpt].")
    resume: bool = option(False, "Continue the interrupted recovery from its checkpoint.")
    kd_chunk_tokens: int = 512
    optim_8bit: bool = option(False, "bitsandbytes 8-bit AdamW (CUDA only).")
    grad_checkpointing: bool = option(False, "Recompute decoder layers in backward (less memory).")
    progress: bool = True

    def __post_init__(self):
        for name in ("steps", "batch_size", "checkpoint_every", "kd_chunk_tokens"):
            check_at_least(f"--{name.replace('_', '-')}", getattr(self, name), 1)
        check_positive(self, "lr")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise GmcError(f"bad --weight-decay {self.weight_decay}: must be non-negative")


@dataclass
class RecoverResult:
    weights: dict[str, torch.Tensor]  # target name -> tuned weight (pruned entries exactly 0), on CPU
    log: bytes
    manifest: dict
    checkpoint_dir: Path  # removed by the caller once the artifact is written


@dataclass
class LearnedGraph:
    """A learned run's graph, handed on to the recovery that follows it (``gmc.masks.training``).

    ``selectors``: the graph's GroupSelectors by target name; ``weights``: each target's pretrained
    weight (the graph's own parameter, which the teacher reads); ``student``: the run's forward
    (compiled or eager; it returns the logits, or ``(logits, *taps)`` with ``--layer-kd``);
    ``teacher``: the run's teacher (its cache kept); ``precision``: the GEMMs' (``autocast``)."""

    selectors: dict[str, "GroupSelector"]
    weights: dict[str, torch.Tensor]
    student: "Student"
    teacher: "Teacher"
    precision: str
    compiled: bool


def recover_weights(model: nn.Module, masks: dict[str, torch.Tensor], pattern: Pattern, blocks: torch.Tensor,
                    config: RecoverConfig, checkpoint_dir: Path, identity: dict, seed: int = 42,
                    weights: Optional[dict[str, torch.Tensor]] = None,
                    teacher: Optional[nn.Module] = None, graph: Optional[LearnedGraph] = None) -> RecoverResult:
    """Tune the kept weights of ``model``'s targets (``masks``) by distillation from the dense model.

    ``weights`` (optional) are starting weights of the targets (e.g. SparseGPT's or a learned run's).
    Eager (``graph`` None): ``model`` is modified in place, its target weights end as the returned
    ones; ``teacher`` is the dense model, by default a copy of ``model`` taken before any change (so
    ``model`` must be dense). On a learned run's ``graph``: ``model`` is left dense, the run's
    student and teacher do the work. ``identity``: what a checkpoint must match to be resumed.
    """
    device = next(model.parameters()).device
    tuner = (_OnGraph(graph, masks, pattern, weights, device) if graph is not None
             else _Eager(model, masks, pattern, weights, teacher, config.grad_checkpointing, device))
    # weight decay pulls the student's weight (W + delta on a graph) towards 0: the tuner applies it
    optimizer = adamw(tuner.params.values(), device, config.optim_8bit, lr=config.lr,
                      weight_decay=config.weight_decay if graph is None else 0.0)
    identity = {**identity, "steps_kind": "recover", "lr": config.lr, "weight_decay": config.weight_decay,
                "batch_size": config.batch_size, "targets": list(masks), **tuner.identity}
    run = Run(checkpoint_dir, identity, config.steps, config.checkpoint_every, config.resume, "recover",
              kind="recovery", progress=config.progress)
    start = resume(run, tuner.params, optimizer)
    started = time.perf_counter()

    def step(k: int) -> tuple[float, dict]:
        batch = batch_indices(k, config.batch_size, blocks.shape[0], seed)
        kd = tuner.step(optimizer, blocks, batch, config)
        return kd, {"step": k, "kd": round(kd, 6)}

    try:
        run_steps(run, step, start, tuner.params, optimizer, lambda record: {"kd": f"{record['kd']:.4f}"})
    finally:
        tuner.close()  # frees the eager teacher's dense copy before the copies below
    tuned = tuner.tuned()
    manifest = {**asdict(config), "trainable_parameters": tuner.trainable,
                "wall_seconds": round(time.perf_counter() - started, 1), **tuner.identity}
    return RecoverResult(tuned, (checkpoint_dir / LOG_FILE).read_bytes(), manifest, checkpoint_dir)


class _Eager:
    """Recovery on the eager model: its target weights train in place, the teacher is a dense copy."""

    def __init__(self, model: nn.Module, masks, pattern: Pattern, weights, teacher, grad_checkpointing: bool,
                 device):
        self.model, self.names, self.device = model, list(masks), device
        self.teacher = copy.deepcopy(model).eval() if teacher is None else teacher
        for parameter in self.teacher.parameters():
            parameter.requires_grad_(False)
        self.params, self.keeps = _kept_weights(model, masks, pattern, weights, device)
        self.trainable = int(sum(int(k.sum()) for k in self.keeps))
        self.identity: dict = {}  # the eager step adds nothing to the recovery's identity
        self.grad_checkpointing = grad_checkpointing
        if grad_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step(self, optimizer, blocks: torch.Tensor, indices: torch.Tensor, config: RecoverConfig) -> float:
        batch = blocks[indices].to(self.device)
        with torch.no_grad(), autocast(self.device, "auto"):
            target = self.teacher(batch).logits
        with autocast(self.device, "auto"):
            student = self.model(batch).logits
        kd = soft_cross_entropy(student, target, config.kd_chunk_tokens)
        optimizer.zero_grad(set_to_none=True)
        kd.backward()
        with torch.no_grad():
            for weight, keep in zip(self.params.values(), self.keeps):
                weight.grad.mul_(keep)
            optimizer.step()
            for weight, keep in zip(self.params.values(), self.keeps):
                weight.mul_(keep)  # AdamW leaves zero-gradient zeros at zero; this makes it a guarantee
        return float(kd.detach())

    def tuned(self) -> dict[str, torch.Tensor]:
        return {name: self.model.get_submodule(name).weight.detach().cpu().clone() for name in self.names}

    def close(self) -> None:
        if self.grad_checkpointing:
            self.model.gradient_checkpointing_disable()
        for weight in self.params.values():
            weight.requires_grad_(False)
        self.teacher = None  # frees the dense copy before the caller's copies


class _OnGraph:
    """Recovery on a learned run's graph: a trained ``delta`` per target (the student's weight is
    ``W + delta``, masked by the selectors, which hold the landed masks), the run's teacher and student.

    The selectors are leaves that require grad, as the learned run's were, so a student compiled by
    that run is reused as it is (its guards hold); their gradients are dropped each step."""

    def __init__(self, graph: LearnedGraph, masks, pattern: Pattern, weights, device):
        self.graph, self.masks, self.pattern, self.device = graph, masks, pattern, device
        self.params = nn.ParameterDict()
        for index, name in enumerate(masks):
            base = graph.weights[name].detach()
            start = weights[name].to(device, torch.float32) if weights and name in weights else base.float()
            self.params[str(index)] = nn.Parameter(start - base.float())  # zero at the pretrained weight
            selector = graph.selectors[name]
            selector.selectors = masks[name].to(device, torch.float32).requires_grad_()
            selector.delta = self.params[str(index)]
        self.trainable = int(sum(int(pattern.expand(m, tuple(graph.weights[n].shape)).sum()) for n, m in masks.items()))
        self.identity = {"student": "learned graph", "precision": graph.precision, "compiled": graph.compiled}

    def step(self, optimizer, blocks: torch.Tensor, indices: torch.Tensor, config: RecoverConfig) -> float:
        batch = blocks[indices].to(self.device)
        target = self.graph.teacher.logits(indices, batch)
        optimizer.zero_grad(set_to_none=True)
        with autocast(self.device, self.graph.precision):
            student = self.graph.student(batch)
        student = student[0] if isinstance(student, tuple) else student
        kd = soft_cross_entropy(student, target, config.kd_chunk_tokens)
        kd.backward()
        with torch.no_grad():
            if config.weight_decay:  # AdamW's decoupled decay of the student's weight, W + delta
                rate = optimizer.param_groups[0]["lr"] * config.weight_decay
                for name, delta in zip(self.masks, self.params.values()):
                    delta.sub_((self.graph.weights[name].float() + delta) * rate)
            optimizer.step()
        for name in self.masks:
            self.graph.selectors[name].selectors.grad = None
        return float(kd.detach())

    def tuned(self) -> dict[str, torch.Tensor]:
        return learned_weights({n: self.graph.weights[n] for n in self.masks}, self.params.values(), self.masks,
                               self.pattern)

    def close(self) -> None:
        for name in self.masks:
            self.graph.selectors[name].selectors = None
            self.graph.selectors[name].delta = None


@torch.no_grad()
def learned_weights(weights: dict, deltas, masks: dict, pattern: Pattern) -> dict[str, torch.Tensor]:
    """``(W + delta) * M`` of every target (``weights``: its pretrained ``W`` by name; ``deltas`` in the same
    order), in the weight's dtype on the host: pruned entries exactly 0. What a learned run's
    ``--learn-weights`` and a recovery on its graph export."""
    return {name: masked_weight((weight.float() + delta).cpu(), masks[name].float().cpu(), pattern).to(weight.dtype)
            for (name, weight), delta in zip(weights.items(), deltas or [])}


def _kept_weights(model: nn.Module, masks, pattern: Pattern, weights, device) -> tuple[nn.ParameterDict, list]:
    """The target weights as trainable parameters, pruned entries zeroed (from ``weights`` where
    given), and their bool keep masks ``[d_out, d_in]``."""
    params, keeps = nn.ParameterDict(), []
    for index, name in enumerate(masks):
        weight = model.get_submodule(name).weight
        keep = pattern.expand(masks[name].to(device), tuple(weight.shape)).to(torch.bool)
        with torch.no_grad():
            if weights and name in weights:
                weight.copy_(weights[name].to(weight.dtype))
            weight.mul_(keep)
        weight.requires_grad_(True)
        params[str(index)] = weight  # the model's own Parameter: training it trains the model
        keeps.append(keep)
    return params, keeps


@dataclass
class RecoverArtifactConfig:
    """``gmc recover``: an artifact in, the same masks with KD-tuned kept weights out."""
    artifact: str
    output: Optional[str] = output_option("Output artifact directory (the same masks + tuned weights).")
    calib: str = calib_option()
    nsamples: Optional[int] = nsamples_option(None)
    seq_len: int = seq_len_option()
    seed: int = seed_option()
    model: Optional[str] = base_model_option()
    dtype: str = dtype_option()
    device: str = device_option()
    overwrite: bool = overwrite_option("masks artifact at -o")
    trust_remote_code: bool = trust_remote_code_option()
    recover: RecoverConfig = field(default_factory=RecoverConfig)

    def __post_init__(self):
        from gmc.formats.outputs import output_path
        from gmc.inputs.model import device_and_dtype

        if self.output is None:
            raise GmcError("recover needs an output artifact directory: -o/--output")
        self.output = str(output_path(self.output))
        self.device, self.dtype = device_and_dtype(self.device, self.dtype)
        if self.nsamples is not None and self.nsamples < 1:
            raise GmcError(f"bad --nsamples {self.nsamples}: must be at least 1")
        check_seq_len(self.seq_len)


def recover_artifact(config: RecoverArtifactConfig, loaded=None):
    """Write ``config.output``: the source masks, weights tuned on ``config.calib``, the manifest
    with ``weights_updated: true`` and a ``recovery`` record; the source's other files copied."""
    from gmc.formats.artifact import (
        MaskArtifact,
        load_artifact,
        model_fingerprint,
        save_artifact,
    )
    from gmc.formats.outputs import check_output
    from gmc.inputs.calib import load_texts, token_blocks
    from gmc.inputs.model import load_model
    from gmc.masks.reconstruct import _other_files

    check_output(config.output, "masks", overwrite=config.overwrite,
                 inputs=[config.artifact, config.model, config.calib])
    source = load_artifact(config.artifact)
    loaded = loaded or load_model(config.model or source.manifest["model"], config.dtype, config.device,
                                  config.trust_remote_code)
    fingerprint = model_fingerprint(loaded.model)
    source.check_matches(loaded.model, fingerprint)
    lines, description = load_texts(config.calib, split="train")
    blocks = token_blocks(loaded.tokenizer, lines, config.seq_len, config.nsamples, config.seed)
    identity = {"model_fingerprint": fingerprint, "artifact": source.manifest.get("model_fingerprint"),
                "group": source.manifest["group"], **blocks_identity(blocks),
                "seed": config.seed, "start": "artifact weights" if source.weights else "dense weights"}
    result = recover_weights(loaded.model, source.masks, source.pattern, blocks, config.recover,
                             checkpoint_path(config.output, config.recover.checkpoint_dir, RECOVER_SUFFIX), identity,
                             config.seed, weights=source.weights)
    manifest = copy.deepcopy(source.manifest)
    manifest["recovery"] = {**result.manifest, "calibration": f"{description}; {blocks.shape[0]} blocks x "
                                                              f"{blocks.shape[1]} tokens",
                            "seed": config.seed, "source": str(config.artifact)}
    artifact = MaskArtifact(source.masks, manifest, result.weights)
    files = [f for f in _other_files(Path(config.artifact)) if f[0] != RECOVER_LOG] + [(RECOVER_LOG, result.log)]
    save_artifact(config.output, artifact, files, overwrite=config.overwrite)
    remove_checkpoint(result.checkpoint_dir)  # only now: a failed write above leaves the run resumable
    return artifact
