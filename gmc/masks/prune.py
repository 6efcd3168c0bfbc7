"""``prune``: the whole pipeline, model reference in, masks artifact out.

    load -> fingerprint -> prepare (trace, find_targets, insert_group_selectors)
         -> mask source (gmc.masks.sources: the one --method names) [-> recover]
         -> artifact [-> fold_masks -> dense HF checkpoint]

Every step is an importable function (``gmc.graph.pipeline`` holds the passes' order); this module only
orders them. The pretrained weights are never modified before the artifact is written
(SparseGPT's in-place update aside; ``--save-dense`` runs the fold pass afterwards).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from gmc.config import (
    check_seq_len,
    device_option,
    dtype_option,
    option,
    output_option,
    overwrite_option,
    refuse_passed,
    seed_option,
    trust_remote_code_option,
)
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
from gmc.graph.targets import TargetFilter
from gmc.groups import Pattern, parse_pattern
from gmc.inputs.calib import calib_option, described_blocks, load_texts, nsamples_option, seq_len_option
from gmc.inputs.model import LoadedModel, device_and_dtype, load_model
from gmc.masks.checkpoint import blocks_identity, checkpoint_path, remove_checkpoint
from gmc.masks.distributed import launched_by_torchrun
from gmc.masks.learn import LearnConfig
from gmc.masks.sources import (
    ALLOCATION_CHOICES,
    ALLOCATION_HELP,
    LEARNED_METHODS,
    METHOD_HELP,
    METHODS,
    SOURCES,
    ChosenMasks,
    MaskSource,
)

HEURISTIC_NSAMPLES = 128


@dataclass
class PruneConfig:
    """What ``gmc prune`` (``prune``: files in, files out) and ``gmc.prune_`` (a model object) do."""

    model: Optional[str] = None  # a hub id, directory, .gguf or smollm2-135m; prune_ takes the model object
    # the artifact directory; prune_ keeps the artifact in memory
    output: Optional[str] = output_option("Output artifact directory (masks + manifest).")
    method: str = option("groupmask", METHOD_HELP, choices=METHODS)
    group: str = option("1x256", "Group shape GOUTxGIN (1x256, 1x64, 32x32, ...), or N:M (2:4) for one-shot methods.")
    sparsity: float = option(0.5, "Target fraction of the target linears' parameters to prune, in (0, 1).")
    allocation: Optional[str] = option(None, ALLOCATION_HELP, choices=ALLOCATION_CHOICES)
    calib: str = calib_option(self_generated=True)
    # None: all blocks of the text for learned methods, HEURISTIC_NSAMPLES otherwise
    nsamples: Optional[int] = nsamples_option(None, f"all for learned methods, {HEURISTIC_NSAMPLES} for one-shot "
                                                    f"ones")
    seq_len: int = seq_len_option()
    seed: int = seed_option()
    include: Optional[str] = option(None, "Regex of target module names [default: the q, k, v, o, gate, up, down "
                                          "projections].")
    ignore: Optional[str] = option(None, "Regex of module names to leave dense.")
    dtype: str = dtype_option()
    device: str = device_option()
    save_dense: Optional[str] = option(None, "Also write an HF checkpoint with the masks folded in (zeros).")
    overwrite: bool = overwrite_option("masks artifact (-o) or dense checkpoint (--save-dense)")
    trust_remote_code: bool = trust_remote_code_option()
    recover_steps: int = option(0, "After the masks: tune the kept weights by distillation for this many steps "
                                   "(gmc recover); 0: off.")
    recover_lr: float = option(1e-4, "Learning rate of --recover-steps.")
    learn: LearnConfig = field(default_factory=LearnConfig)

    def __post_init__(self):
        self.targets = TargetFilter(self.include, self.ignore)  # the one target filter of this run
        if self.output is not None:
            self.output = str(output_path(self.output))  # one spelling: "out/" and "out" share out.ckpt
        # a learned run's checkpoint directory, resolved once for the output check and the run
        self.checkpoint = None if self.output is None else checkpoint_path(self.output, self.learn.checkpoint_dir)
        if self.save_dense:
            self.save_dense = str(output_path(self.save_dense))
        if self.method not in SOURCES:
            raise GmcError(f"unknown method {self.method!r}: expected one of {', '.join(METHODS)}")
        source = SOURCES[self.method]
        self.pattern: Pattern = parse_pattern(self.group)
        if source.learns and not self.pattern.learnable:
            raise GmcError(f"{self.pattern} is an N:M pattern; learned methods take group shapes like 1x256")
        fixed = self.pattern.fixed_sparsity
        if fixed is not None and abs(self.sparsity - fixed) > 1e-9:
            raise GmcError(f"--group {self.pattern} fixes sparsity at {fixed}; got {self.sparsity}")
        if not 0.0 < self.sparsity < 1.0:
            raise GmcError(f"bad --sparsity {self.sparsity}: must be strictly between 0 and 1")
        self._refuse_unused(source)
        if fixed is not None:
            self.allocation = str(self.pattern)  # the pattern allocates: n of every m inputs in each row
        elif self.allocation is None:
            self.allocation = source.allocations[0]
        if fixed is None and self.allocation not in source.allocations:
            raise GmcError(f"--allocation {self.allocation!r} does not go with --method {self.method}: "
                           f"expected one of {', '.join(source.allocations)}")
        if self.nsamples is not None and self.nsamples < 1:
            raise GmcError(f"bad --nsamples {self.nsamples}: must be at least 1")
        if self.nsamples is None and self.needs_blocks and (not source.learns or self.calib == "self"):
            # a one-shot score needs few blocks; self-calibration has no text to end it
            self.nsamples = HEURISTIC_NSAMPLES
        # the source of a learned run's prior, from the table (the learned sources read it here)
        self.init_source: Optional[MaskSource] = SOURCES.get(self.learn.init) if source.learns else None
        check_seq_len(self.seq_len)
        self.device, self.dtype = device_and_dtype(self.device, self.dtype)
        if self.recover_steps < 0:
            raise GmcError(f"bad --recover-steps {self.recover_steps}: must be 0 (off) or more")

    def _refuse_unused(self, source: MaskSource) -> None:
        """Refuse the options this run would not read ("passed": other than the field's default)."""
        method = f"--method {self.method}"
        if not source.learns:
            options = [f.name for f in fields(LearnConfig) if f.name not in ("progress", "resume")]
            refuse_passed(self.learn, options, f"applies to the learned methods ({', '.join(LEARNED_METHODS)}), "
                                               f"not to {method}")
            if not self.recover_steps:
                refuse_passed(self.learn, ("resume",), f"continues a learned run or a recovery; {method} learns "
                                                       f"nothing without --recover-steps")
        refuse_passed(self.learn, source.ignores, f"does not apply to {method}")
        if not self.recover_steps:
            refuse_passed(self, ("recover_lr",), "applies with --recover-steps")
        if not (source.needs_blocks or self.recover_steps):
            refuse_passed(self, ("calib", "nsamples", "seq_len"), f"does not apply to {method}: it reads no "
                                                                   f"calibration data (without --recover-steps)")
        if self.pattern.fixed_sparsity is not None and self.allocation not in (None, str(self.pattern)):
            raise GmcError(f"--allocation does not apply to the N:M pattern {self.pattern}: it fixes every row's "
                           f"sparsity")

    @property
    def needs_blocks(self) -> bool:
        """Whether the run reads calibration blocks: its mask source's, or recovery's."""
        return SOURCES[self.method].needs_blocks or self.recover_steps > 0

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
                  dense=config.save_dense, checkpoint=config.checkpoint if SOURCES[config.method].learns else None)
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
    chosen = SOURCES[config.method].choose(config, loaded, gm, targets, selectors, blocks, fingerprint)
    if config.recover_steps:
        chosen = recover_in_prune(config, loaded, chosen, blocks, fingerprint, calibration)
    chosen.graph = None  # a learned run's student and teacher (its cache) are no longer needed
    manifest = build_manifest(
        model_ref=loaded.ref, fingerprint=fingerprint, pattern=config.pattern, masks=chosen.masks,
        shapes={t.name: t.shape for t in targets}, method=config.method,
        allocation=config.allocation,
        target_sparsity=config.sparsity, calibration=calibration, seed=config.seed,
        nsamples=None if blocks is None else int(blocks.shape[0]),
        seq_len=None if blocks is None else int(blocks.shape[1]), **chosen.manifest,
    )
    return MaskArtifact(chosen.masks, manifest, chosen.weights), chosen


def recover_in_prune(config: PruneConfig, loaded: LoadedModel, chosen: ChosenMasks, blocks, fingerprint: str,
                     calibration: str) -> ChosenMasks:
    """``--recover-steps``: tune the kept weights right after the masks are chosen (``gmc.masks.recover``)."""
    from gmc.masks.recover import (
        RECOVER_LOG,
        RECOVER_SUFFIX,
        RecoverConfig,
        recover_weights,
    )

    # the run's --checkpoint-every, and at least as often as gmc recover's own default
    every = min(config.learn.checkpoint_every, RecoverConfig.checkpoint_every)
    settings = RecoverConfig(steps=config.recover_steps, lr=config.recover_lr, resume=config.learn.resume,
                             progress=config.learn.progress, checkpoint_every=every)
    identity = {"model_fingerprint": fingerprint, "method": config.method, "group": str(config.pattern),
                "sparsity": config.sparsity, "seed": config.seed, **blocks_identity(blocks),
                "masks_sum": int(sum(int(m.sum()) for m in chosen.masks.values()))}
    recovery = recover_weights(loaded.model, chosen.masks, config.pattern, blocks, settings,
                               checkpoint_path(config.output, suffix=RECOVER_SUFFIX), identity, config.seed,
                               weights=chosen.weights or None, teacher=chosen.teacher, graph=chosen.graph)
    manifest = {**chosen.manifest, "recovery": {**recovery.manifest, "calibration": calibration, "seed": config.seed}}
    return ChosenMasks(chosen.masks, recovery.weights, [*chosen.files, (RECOVER_LOG, recovery.log)], manifest,
                       [*chosen.checkpoints, recovery.checkpoint_dir])
