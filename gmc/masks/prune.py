"""``prune``: the whole pipeline, model reference in, masks artifact out.

    load -> fingerprint -> prepare (trace, find_targets, insert_group_selectors)
         -> mask source (learned | magnitude | wanda | sparsegpt) [-> recover]
         -> artifact [-> fold_masks -> dense HF checkpoint]

Every step is an importable function (``gmc.graph.pipeline`` holds the passes' order); this module only
orders them. The pretrained weights are never modified before the artifact is written
(SparseGPT's in-place update aside; ``--save-dense`` runs the fold pass afterwards).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from gmc.config import check_seq_len
from gmc.errors import GmcError
from gmc.formats.artifact import (
    MaskArtifact,
    build_manifest,
    model_fingerprint,
    save_artifact,
)
from gmc.formats.hf_checkpoint import save_dense
from gmc.formats.outputs import check_outputs, output_path
from gmc.graph.pipeline import Prepared, fold_prepared, prepare
from gmc.graph.selector import GroupSelector
from gmc.graph.targets import Target, TargetFilter
from gmc.groups import NMSpec, Pattern, parse_pattern
from gmc.inputs.calib import described_blocks, load_texts
from gmc.inputs.model import (
    AUTO,
    LoadedModel,
    auto_device,
    auto_dtype,
    check_device,
    load_model,
)
from gmc.masks.distributed import launched_by_torchrun
from gmc.masks.checkpoint import blocks_identity, checkpoint_path, remove_checkpoint
from gmc.masks.heuristics import ALLOCATIONS, ActivationNorms, heuristic_masks
from gmc.masks.learn import (
    LEARNED_ALLOCATIONS,
    LearnConfig,
    MaskTask,
    learn_masks,
)

LEARNED_METHODS = ("groupmask", "direct")
HEURISTIC_METHODS = ("magnitude", "wanda")
METHODS = LEARNED_METHODS + HEURISTIC_METHODS + ("sparsegpt",)
HEURISTIC_NSAMPLES = 128
PRIOR_NSAMPLES = 64  # calibration blocks of a learned run's one-shot prior (--init)


@dataclass
class PruneConfig:
    """What ``gmc prune`` (``prune``: files in, files out) and ``gmc.prune_`` (a model object) do."""

    model: Optional[str] = None  # a hub id, directory, .gguf or smollm2-135m; prune_ takes the model object
    output: Optional[str] = None  # the artifact directory; prune_ keeps the artifact in memory
    method: str = "groupmask"
    group: str = "1x256"
    sparsity: float = 0.5
    allocation: Optional[str] = None  # None: adaptive for learned methods, uniform otherwise
    calib: str = "wikitext2"
    nsamples: Optional[int] = None  # None: all blocks of the text for learned methods, 128 otherwise
    seq_len: int = 2048
    seed: int = 42
    include: Optional[str] = None
    ignore: Optional[str] = None
    dtype: str = AUTO  # bfloat16 on CUDA, float32 on CPU
    device: str = AUTO  # cuda when available, else cpu
    save_dense: Optional[str] = None
    overwrite: bool = False  # replace an existing gmc output of the same kind at -o / --save-dense
    trust_remote_code: bool = False  # let transformers execute a model repository's own code
    recover_steps: int = 0  # gmc.masks.recover after the masks: 0 = off
    recover_lr: float = 1e-4
    learn: LearnConfig = field(default_factory=LearnConfig)

    def __post_init__(self):
        self.targets = TargetFilter(self.include, self.ignore)  # the one target filter of this run
        if self.output is not None:
            self.output = str(output_path(self.output))  # one spelling: "out/" and "out" share out.ckpt
        # a learned run's checkpoint directory, resolved once for the output check and the run
        self.checkpoint = None if self.output is None else checkpoint_path(self.output, self.learn.checkpoint_dir)
        if self.save_dense:
            self.save_dense = str(output_path(self.save_dense))
        if self.method not in METHODS:
            raise GmcError(f"unknown method {self.method!r}: expected one of {', '.join(METHODS)}")
        self.pattern: Pattern = parse_pattern(self.group)
        if isinstance(self.pattern, NMSpec):
            if self.method in LEARNED_METHODS:
                raise GmcError(f"{self.pattern} is an N:M pattern; learned methods take group shapes like 1x256")
            if abs(self.sparsity - self.pattern.sparsity) > 1e-9:
                raise GmcError(f"--group {self.pattern} fixes sparsity at {self.pattern.sparsity}; got {self.sparsity}")
        if not 0.0 < self.sparsity < 1.0:
            raise GmcError(f"bad --sparsity {self.sparsity}: must be strictly between 0 and 1")
        allowed = LEARNED_ALLOCATIONS if self.method in LEARNED_METHODS else (
            ("uniform",) if self.method == "sparsegpt" else ALLOCATIONS)
        if self.allocation is None:
            self.allocation = allowed[0]
        if self.allocation not in allowed:
            raise GmcError(f"--allocation {self.allocation!r} does not go with --method {self.method}: "
                           f"expected one of {', '.join(allowed)}")
        if self.nsamples is not None and self.nsamples < 1:
            raise GmcError(f"bad --nsamples {self.nsamples}: must be at least 1")
        if self.nsamples is None and (self.method not in LEARNED_METHODS or self.calib == "self"):
            self.nsamples = HEURISTIC_NSAMPLES  # a one-shot score needs few blocks; self-calibration has no text to end it
        check_seq_len(self.seq_len)
        self.device = check_device(auto_device(self.device))
        self.dtype = auto_dtype(self.dtype, self.device)
        if self.recover_steps < 0:
            raise GmcError(f"bad --recover-steps {self.recover_steps}: must be 0 (off) or more")
        check_device(self.device)

    @property
    def needs_blocks(self) -> bool:
        """Magnitude scores the weights alone; recovery and every other method run calibration blocks."""
        return self.method != "magnitude" or self.recover_steps > 0

    @property
    def reads_text(self) -> bool:
        """Whether the run reads its calibration text (``--calib self``: the model writes its own)."""
        return self.needs_blocks and self.calib != "self"


def prune(config: PruneConfig, loaded: Optional[LoadedModel] = None) -> MaskArtifact:
    """Run the pipeline of ``config``; write the artifact (and dense checkpoint) atomically.

    One process; a torchrun worker runs ``gmc.masks.prune_distributed`` instead (``gmc prune`` chooses).
    """
    if config.model is None or config.output is None:
        raise GmcError("prune needs a model reference and an output directory (gmc.prune_ takes a model object)")
    if loaded is None and launched_by_torchrun():
        raise GmcError("prune runs in one process; under torchrun call gmc.masks.prune_distributed.prune_distributed "
                       "(gmc prune does)")
    check_outputs(config.output, "masks", inputs=[config.model, config.calib], overwrite=config.overwrite,
                  dense=config.save_dense, checkpoint=config.checkpoint if config.method in LEARNED_METHODS else None)
    # a bad calibration source fails in a second, not after loading a model
    lines = load_texts(config.calib, split="train") if config.reads_text else None
    loaded = loaded or load_model(config.model, config.dtype, config.device, config.trust_remote_code)
    blocks, described = None, "none (weights only)"
    if config.needs_blocks:
        blocks, described = described_blocks(loaded, lines, config.seq_len, config.nsamples, config.seed)
    fingerprint = model_fingerprint(loaded.model)
    prepared = prepare(loaded.model, config.pattern, config.targets)  # trace, the target set, selectors
    artifact, chosen = choose_artifact(config, loaded, prepared, fingerprint, blocks, described)
    save_artifact(config.output, artifact, chosen.files, overwrite=config.overwrite)
    if config.save_dense:  # after the artifact: folding changes the weights in place
        fold_prepared(prepared.gm, artifact.masks, artifact.weights)
        save_dense(loaded.model, loaded.tokenizer, config.save_dense, overwrite=config.overwrite)
    for checkpoint in chosen.checkpoints:  # only now: a failed write above leaves the run resumable
        remove_checkpoint(checkpoint)
    return artifact


def choose_artifact(config: PruneConfig, loaded: LoadedModel, prepared: Prepared, fingerprint: str,
                    blocks: Optional[torch.Tensor], calibration: str) -> tuple[MaskArtifact, "ChosenMasks"]:
    """The masks artifact of ``config`` for ``loaded`` (``prepared``: its graph with selectors,
    ``fingerprint``: its weights' hash) on calibration ``blocks`` (None: weights only), with what the
    mask source produced: ``gmc prune`` and ``gmc.prune_`` both run this."""
    gm, targets, selectors = prepared
    chosen = choose_masks(config, loaded, gm, targets, selectors, blocks, fingerprint)  # the mask source
    if config.recover_steps:
        chosen = recover_in_prune(config, loaded, chosen, blocks, fingerprint, calibration)
    manifest = build_manifest(
        model_ref=loaded.ref, fingerprint=fingerprint, pattern=config.pattern, masks=chosen.masks,
        shapes={t.name: t.shape for t in targets}, method=config.method,
        allocation=str(config.pattern) if isinstance(config.pattern, NMSpec) else config.allocation,
        target_sparsity=config.sparsity, calibration=calibration, seed=config.seed,
        nsamples=None if blocks is None else int(blocks.shape[0]),
        seq_len=None if blocks is None else int(blocks.shape[1]), **chosen.manifest,
    )
    return MaskArtifact(chosen.masks, manifest, chosen.weights), chosen


@dataclass
class ChosenMasks:
    """What a mask source (and recovery) produced, before it becomes an artifact."""

    masks: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # updated target weights, if any
    files: list = field(default_factory=list)  # (name, bytes) written into the artifact
    manifest: dict = field(default_factory=dict)  # extra manifest entries
    checkpoints: list[Path] = field(default_factory=list)  # removed once the artifact is written
    teacher: Optional[torch.nn.Module] = None  # the dense model, when the source changed the weights


def choose_masks(config: PruneConfig, loaded: LoadedModel, gm: torch.fx.GraphModule, targets: list[Target],
                 selectors: dict[str, GroupSelector], blocks: Optional[torch.Tensor], fingerprint: str) -> ChosenMasks:
    """The mask source of ``config.method`` for ``gm``'s ``selectors``: learned selectors, SparseGPT,
    or a heuristic score."""
    if config.method in LEARNED_METHODS:
        prior = mask_prior(config, loaded, gm, targets, selectors, blocks)
        result = learn_masks(gm, targets, selectors, blocks, mask_task(config, fingerprint), config.learn, prior=prior)
        return ChosenMasks(result.masks, result.weights, files=list(result.files), manifest=dict(result.manifest),
                           checkpoints=[result.checkpoint_dir])
    if config.method == "sparsegpt":
        from gmc.masks.sparsegpt import sparsegpt_prune

        # SparseGPT updates the model in place: recovery needs the dense teacher
        teacher = copy.deepcopy(loaded.model) if config.recover_steps else None
        masks, weights = sparsegpt_prune(loaded, config.pattern, config.sparsity, blocks,
                                         {t.name for t in targets}.__contains__)
        return ChosenMasks(masks, weights, teacher=teacher)
    norms = activation_norms(gm, selectors, blocks) if config.method == "wanda" else None
    weights = {t.name: gm.get_parameter(t.node.args[1].target) for t in targets}
    return ChosenMasks(heuristic_masks(weights, config.pattern, config.sparsity, config.method,
                                       config.allocation, norms))


def mask_task(config: PruneConfig, fingerprint: str) -> MaskTask:
    """The learned run of ``config`` on the model of ``fingerprint``."""
    return MaskTask(config.method, config.pattern, config.sparsity, config.allocation, config.seed, fingerprint,
                    config.checkpoint)


def recover_in_prune(config: PruneConfig, loaded: LoadedModel, chosen: ChosenMasks, blocks, fingerprint: str,
                     calibration: str) -> ChosenMasks:
    """``--recover-steps``: tune the kept weights right after the masks are chosen (``gmc.masks.recover``)."""
    from gmc.masks.recover import (
        RECOVER_LOG,
        RECOVER_SUFFIX,
        RecoverConfig,
        recover_weights,
    )

    settings = RecoverConfig(steps=config.recover_steps, lr=config.recover_lr, resume=config.learn.resume,
                             progress=config.learn.progress)
    identity = {"model_fingerprint": fingerprint, "method": config.method, "group": str(config.pattern),
                "sparsity": config.sparsity, "seed": config.seed, **blocks_identity(blocks),
                "masks_sum": int(sum(int(m.sum()) for m in chosen.masks.values()))}
    recovery = recover_weights(loaded.model, chosen.masks, config.pattern, blocks, settings,
                               checkpoint_path(config.output, suffix=RECOVER_SUFFIX), identity, config.seed,
                               weights=chosen.weights or None, teacher=chosen.teacher)
    manifest = {**chosen.manifest, "recovery": {**recovery.manifest, "calibration": calibration, "seed": config.seed}}
    return ChosenMasks(chosen.masks, recovery.weights, [*chosen.files, (RECOVER_LOG, recovery.log)], manifest,
                       [*chosen.checkpoints, recovery.checkpoint_dir])


def mask_prior(config: PruneConfig, loaded: LoadedModel, gm, targets: list[Target],
               selectors: dict[str, GroupSelector], blocks: torch.Tensor):
    """The one-shot prior of a learned run (``--init``), or None; calibration: the first
    ``PRIOR_NSAMPLES`` blocks of the run's own."""
    init = config.learn.init
    if init == "none":
        return None
    from gmc.masks.prior import MaskPrior, prior_from_scores, sparsegpt_prior

    sample = blocks[:PRIOR_NSAMPLES]
    if init == "sparsegpt":
        logits, masks = sparsegpt_prior(loaded, config.pattern, config.sparsity, sample,
                                        {t.name for t in targets}.__contains__)
    else:
        norms = activation_norms(gm, selectors, sample) if init == "wanda" else None
        weights = {t.name: gm.get_parameter(t.node.args[1].target) for t in targets}
        logits, masks = prior_from_scores(weights, config.pattern, config.sparsity, init, norms)
    return MaskPrior(logits, masks, init)


@torch.no_grad()
def activation_norms(gm: torch.fx.GraphModule, selectors: dict[str, GroupSelector], blocks: torch.Tensor) -> dict:
    """``||X_j||_2`` of the input of every target of ``selectors`` (``gm``'s) over the calibration blocks (Wanda)."""
    observers = {name: ActivationNorms(selector.shape[1]) for name, selector in selectors.items()}
    for name, observer in observers.items():
        selectors[name].observer = observer
    device = next(iter(gm.parameters())).device
    try:
        for block in tqdm(blocks, desc="calibration", unit="seq", leave=False):
            gm(block[None].to(device))
    finally:
        for selector in selectors.values():
            selector.observer = None
    return {name: observer.norm() for name, observer in observers.items()}
