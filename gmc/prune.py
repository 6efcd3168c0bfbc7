"""``prune``: the whole pipeline, model reference in, masks artifact out.

    load -> fingerprint -> trace -> find_targets -> insert_group_selectors
         -> mask source (learned | magnitude | wanda | sparsegpt) -> artifact [-> dense HF checkpoint]

Every step is an importable function; this module only orders them. The pretrained weights are
never modified before the artifact is written (``--save-dense`` folds the masks afterwards).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from gmc.artifact import MaskArtifact, atomic_dir, build_manifest, save_artifact
from gmc.calib import load_texts, token_blocks
from gmc.distributed import launched_by_torchrun, prune_distributed
from gmc.errors import GmcError
from gmc.groups import NMSpec, Pattern, parse_pattern
from gmc.heuristics import ALLOCATIONS, ActivationNorms, heuristic_masks
from gmc.learn import LEARNED_ALLOCATIONS, LearnConfig
from gmc.model import AUTO, LoadedModel, auto_device, auto_dtype, check_device, load_model, model_fingerprint
from gmc.outputs import check_output, check_writable, output_path, overlaps
from gmc.passes.find_targets import Target, find_targets
from gmc.passes.insert_group_selectors import insert_group_selectors
from gmc.selector import selector_modules
from gmc.trace import trace_model

LEARNED_METHODS = ("groupmask", "direct")
HEURISTIC_METHODS = ("magnitude", "wanda")
METHODS = LEARNED_METHODS + HEURISTIC_METHODS + ("sparsegpt",)
HEURISTIC_NSAMPLES = 128
PRIOR_NSAMPLES = 64  # calibration blocks of a learned run's one-shot prior (--init)


@dataclass
class PruneConfig:
    model: str
    output: str
    method: str = "groupmask"
    group: str = "1x256"
    sparsity: float = 0.5
    allocation: Optional[str] = None  # None: adaptive for learned methods, uniform otherwise
    calib: str = "wikitext2"
    nsamples: Optional[int] = None  # None: all blocks for learned methods, 128 otherwise
    seq_len: int = 2048
    seed: int = 42
    include: Optional[str] = None
    ignore: Optional[str] = None
    dtype: str = AUTO  # bfloat16 on CUDA, float32 on CPU
    device: str = AUTO  # cuda when available, else cpu
    save_dense: Optional[str] = None
    overwrite: bool = False  # replace an existing gmc output of the same kind at -o / --save-dense
    trust_remote_code: bool = False  # let transformers run a model repository's own code
    recover_steps: int = 0  # gmc.recover after the masks: 0 = off
    recover_lr: float = 1e-4
    learn: LearnConfig = field(default_factory=LearnConfig)

    def __post_init__(self):
        self.output = str(output_path(self.output))  # one spelling: "out/" and "out" share out.ckpt
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
        if self.seq_len < 2:
            raise GmcError(f"bad --seq-len {self.seq_len}: must be at least 2")
        self.device = check_device(auto_device(self.device))
        self.dtype = auto_dtype(self.dtype, self.device)
        if self.recover_steps < 0:
            raise GmcError(f"bad --recover-steps {self.recover_steps}: must be 0 (off) or more")
        check_device(self.device)


def default(name: str):
    """The default of a PruneConfig field (the CLI reads defaults from here, never twice)."""
    for f in dataclasses.fields(PruneConfig):
        if f.name == name:
            return f.default
    raise KeyError(name)


def prune(config: PruneConfig, loaded: Optional[LoadedModel] = None) -> Optional[MaskArtifact]:
    """Run the pipeline of ``config``; write the artifact (and dense checkpoint) atomically.

    Under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) the learned methods run data
    parallel on FSDP2 (``gmc.distributed``); rank 0 returns the artifact, the others None.
    """
    check_outputs(config)
    if loaded is None and launched_by_torchrun():
        return prune_distributed(config)
    # read the calibration text first: a bad source fails in a second, not after loading a model
    lines = calib_lines(config)
    loaded = loaded or load_model(config.model, config.dtype, config.device, config.trust_remote_code)
    fingerprint = model_fingerprint(loaded.model)
    gm = trace_model(loaded.model)
    targets = find_targets(gm, config.include, config.ignore)
    insert_group_selectors(gm, targets, config.pattern)
    shapes = {t.name: t.shape for t in targets}

    extra_files, extra_manifest, checkpoint, teacher = [], {}, None, None
    calibration = "none (weights only)"
    blocks = None
    if config.method != "magnitude" or config.recover_steps:
        blocks, calibration = calibration_blocks(config, loaded, lines)
    if config.method in LEARNED_METHODS:
        from gmc.learn import learn_masks

        prior = mask_prior(config, loaded, gm, targets, blocks)
        result = learn_masks(gm, targets, config, blocks, fingerprint, prior=prior)
        masks, extra_files, extra_manifest = result.masks, result.files, result.manifest
        checkpoint = result.checkpoint_dir
    elif config.method == "sparsegpt":
        from gmc.sparsegpt import sparsegpt_prune

        if config.recover_steps:  # SparseGPT updates the model in place: keep the dense teacher
            import copy

            teacher = copy.deepcopy(loaded.model)
        masks, weights = sparsegpt_prune(loaded, config.pattern, config.sparsity, blocks,
                                         include=config.include, ignore=config.ignore)
        extra_manifest["weights"] = weights
    else:
        norms = activation_norms(gm, targets, blocks) if config.method == "wanda" else None
        weights = {t.name: gm.get_parameter(t.node.args[1].target) for t in targets}
        masks = heuristic_masks(weights, config.pattern, config.sparsity, config.method,
                                config.allocation, norms)

    updated = extra_manifest.pop("weights", {})
    recovery = None
    if config.recover_steps:
        recovery = recover_in_prune(config, loaded, masks, updated, blocks, fingerprint, teacher)
        updated = recovery.weights
        from gmc.recover import RECOVER_LOG

        extra_files = extra_files + [(RECOVER_LOG, recovery.log)]
        extra_manifest["recovery"] = {**recovery.manifest, "calibration": calibration, "seed": config.seed}
    manifest = build_manifest(
        model_ref=loaded.ref, fingerprint=fingerprint, pattern=config.pattern, masks=masks,
        shapes=shapes, method=config.method,
        allocation=str(config.pattern) if isinstance(config.pattern, NMSpec) else config.allocation,
        target_sparsity=config.sparsity, calibration=calibration, seed=config.seed,
        nsamples=None if blocks is None else int(blocks.shape[0]),
        seq_len=None if blocks is None else int(blocks.shape[1]), **extra_manifest,
    )
    artifact = MaskArtifact(masks, manifest, updated)
    save_artifact(config.output, artifact, extra_files, overwrite=config.overwrite)
    if config.save_dense:
        save_dense(loaded, artifact, config.save_dense, overwrite=config.overwrite)
    if checkpoint is not None:  # only now: a failed write above leaves the run resumable
        from gmc.learn import remove_checkpoint

        remove_checkpoint(checkpoint)
    if recovery is not None:
        from gmc.learn import remove_checkpoint

        remove_checkpoint(recovery.checkpoint_dir)
    return artifact


def recover_in_prune(config: PruneConfig, loaded: LoadedModel, masks, weights, blocks, fingerprint, teacher):
    """``--recover-steps``: tune the kept weights right after the masks are chosen (``gmc.recover``)."""
    from gmc.recover import RecoverConfig, recover_weights
    from gmc.outputs import output_path

    settings = RecoverConfig(steps=config.recover_steps, lr=config.recover_lr, resume=config.learn.resume,
                             progress=config.learn.progress)
    identity = {"model_fingerprint": fingerprint, "method": config.method, "group": str(config.pattern),
                "sparsity": config.sparsity, "seed": config.seed, "blocks": list(blocks.shape),
                "blocks_sum": int(blocks.sum()), "masks_sum": int(sum(int(m.sum()) for m in masks.values()))}
    return recover_weights(loaded.model, masks, config.pattern, blocks, settings,
                           output_path(f"{config.output}.recover-ckpt"), identity, config.seed,
                           weights=weights or None, teacher=teacher)


def check_outputs(config: PruneConfig) -> None:
    """Refuse, before any work, outputs that exist (without ``--overwrite``), cannot be written, or
    overlap an input or each other (``gmc.outputs``)."""
    inputs = [config.model, config.calib]
    check_output(config.output, "masks", overwrite=config.overwrite, inputs=inputs)
    if config.save_dense:  # it may lie inside -o, never be or hold it
        dense, output = output_path(config.save_dense), output_path(config.output)
        if dense == output or dense in output.parents:
            raise GmcError(f"--save-dense {dense} would replace the artifact -o {output}: choose a directory "
                           f"outside it (or inside it, e.g. {output / 'hf'})")
        check_output(config.save_dense, "dense", overwrite=config.overwrite, inputs=[*inputs, config.output],
                     option="--save-dense")
    if config.method in LEARNED_METHODS:
        from gmc.learn import checkpoint_path

        checkpoint = checkpoint_path(config)
        local_inputs = [i for i in inputs if Path(i).expanduser().exists()]
        for other in (config.output, config.save_dense, *local_inputs):
            if other and overlaps(checkpoint, other):
                raise GmcError(f"the checkpoint directory {checkpoint} overlaps {other}: pass a --checkpoint-dir "
                               f"outside it")
        check_writable(checkpoint, "--checkpoint-dir")


def mask_prior(config: PruneConfig, loaded: LoadedModel, gm, targets: list[Target], blocks: torch.Tensor):
    """The one-shot prior of a learned run (``--init``), or None; calibration: the first
    ``PRIOR_NSAMPLES`` blocks of the run's own."""
    init = config.learn.init
    if init == "none":
        return None
    from gmc.prior import MaskPrior, prior_from_scores, sparsegpt_prior

    sample = blocks[:PRIOR_NSAMPLES]
    if init == "sparsegpt":
        logits, masks = sparsegpt_prior(loaded, config.pattern, config.sparsity, sample, config.include, config.ignore)
    else:
        norms = activation_norms(gm, targets, sample) if init == "wanda" else None
        weights = {t.name: gm.get_parameter(t.node.args[1].target) for t in targets}
        logits, masks = prior_from_scores(weights, config.pattern, config.sparsity, init, norms)
    return MaskPrior(logits, masks, init)


def calib_lines(config: PruneConfig) -> Optional[tuple[list[str], str]]:
    """The calibration text lines and their description (None when no text is needed)."""
    if (config.method == "magnitude" and not config.recover_steps) or config.calib == "self":
        return None
    return load_texts(config.calib, split="train")


def calibration_blocks(config: PruneConfig, loaded: LoadedModel, lines) -> tuple[torch.Tensor, str]:
    """``[n, seq_len]`` calibration token blocks and their description."""
    nsamples = config.nsamples
    if nsamples is None and config.method not in LEARNED_METHODS:
        nsamples = HEURISTIC_NSAMPLES
    if config.calib == "self":
        from gmc.calib import self_generated_blocks

        blocks = self_generated_blocks(loaded, nsamples or HEURISTIC_NSAMPLES, config.seq_len, config.seed)
        return blocks, f"self (sampled from the dense model, seed {config.seed})"
    text, description = lines
    blocks = token_blocks(loaded.tokenizer, text, config.seq_len, nsamples, config.seed)
    return blocks, f"{description}; {blocks.shape[0]} blocks x {blocks.shape[1]} tokens"


@torch.no_grad()
def activation_norms(gm: torch.fx.GraphModule, targets: list[Target], blocks: torch.Tensor) -> dict:
    """``||X_j||_2`` of every target's input over the calibration blocks (Wanda)."""
    modules = selector_modules(gm)
    observers = {t.name: ActivationNorms(t.shape[1]) for t in targets}
    for name, observer in observers.items():
        modules[name].observer = observer
    device = next(iter(gm.parameters())).device
    try:
        for block in tqdm(blocks, desc="calibration", unit="seq", leave=False):
            gm(block[None].to(device))
    finally:
        for module in modules.values():
            module.observer = None
    return {name: observer.norm() for name, observer in observers.items()}


@torch.no_grad()
def save_dense(loaded: LoadedModel, artifact: MaskArtifact, path: str, overwrite: bool = False) -> Path:
    """Fold the masks into the eager model (in place) and save an HF checkpoint + tokenizer."""
    # the artifact was just made from this model; SparseGPT may have updated its weights already
    artifact.apply_to(loaded.model, check_fingerprint=False)
    with atomic_dir(path, "dense", overwrite) as tmp:
        loaded.model.save_pretrained(tmp)
        if loaded.tokenizer is not None and hasattr(loaded.tokenizer, "save_pretrained"):
            loaded.tokenizer.save_pretrained(tmp)
    return Path(path)
