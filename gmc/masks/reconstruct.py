"""``reconstruct``: a masks artifact in, the same masks with SparseGPT-updated weights out.

    load artifact -> load its dense base model -> check fingerprint -> calibration blocks
        -> gmc.masks.sparsegpt.reconstruct (OBS update for the given masks) -> new artifact

The new artifact carries ``weights.safetensors`` (the updated target weights), the manifest says
``weights_updated: true`` and records the run under ``reconstruction``; every other manifest key
and every other file of the source artifact is copied unchanged. Weights already present in the
source artifact are ignored: the update always starts from the dense model.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gmc.config import (
    base_model_option,
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
from gmc.formats.artifact import (
    MANIFEST_FILE,
    MASKS_FILE,
    WEIGHTS_FILE,
    MaskArtifact,
    load_artifact,
    model_fingerprint,
    save_artifact,
)
from gmc.formats.outputs import MARKER, check_output, output_path
from gmc.inputs.calib import calib_option, load_texts, nsamples_option, seq_len_option, token_blocks
from gmc.inputs.model import LoadedModel, device_and_dtype, load_model
from gmc.masks.sparsegpt import DAMP, RECONSTRUCT_REFINE_STEPS, TARGETS
from gmc.masks.sparsegpt import reconstruct as reconstruct_weights


@dataclass
class ReconstructConfig:
    artifact: str
    output: Optional[str] = output_option("Output artifact directory (the same masks + updated weights).")
    calib: Optional[str] = calib_option(None)
    nsamples: int = nsamples_option(128)
    seq_len: int = seq_len_option()
    seed: int = seed_option()
    model: Optional[str] = base_model_option()
    dtype: str = dtype_option()
    device: str = device_option()
    damp: float = option(DAMP, "Hessian dampening, fraction of its mean diagonal.")
    refine_steps: int = option(RECONSTRUCT_REFINE_STEPS, "Conjugate-gradient steps after the OBS sweep (towards "
                                                         "the exact least-squares fit).")
    target: str = option("pruned", "pruned: fit each layer to the dense weights on the pruned model's inputs "
                                   "(SparseGPT); dense: fit it to the dense model's own outputs (compensates earlier "
                                   "layers' errors).", choices=TARGETS)
    progress: bool = True
    overwrite: bool = overwrite_option("masks artifact at -o")
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        if self.output is None or self.calib is None:
            raise GmcError("reconstruct needs an output artifact directory (-o/--output) and calibration text "
                           "(--calib)")
        self.output = str(output_path(self.output))
        if self.nsamples < 1:
            raise GmcError(f"bad --nsamples {self.nsamples}: must be at least 1")
        check_seq_len(self.seq_len)
        self.device, self.dtype = device_and_dtype(self.device, self.dtype)
        if not 0.0 <= self.damp:
            raise GmcError(f"bad --damp {self.damp}: must be non-negative")
        if self.target not in TARGETS:
            raise GmcError(f"bad --target {self.target!r}: expected one of {', '.join(TARGETS)}")
        if self.refine_steps < 0:
            raise GmcError(f"bad --refine-steps {self.refine_steps}: must be non-negative")
        if Path(self.output).resolve() == Path(self.artifact).resolve():
            raise GmcError("-o must differ from the source artifact (it is read while writing)")


def reconstruct_artifact(config: ReconstructConfig, loaded: Optional[LoadedModel] = None) -> MaskArtifact:
    """Write ``config.output``: the source masks plus weights updated on ``config.calib``.

    ``loaded`` (optional) must be the dense base model; it is modified in place.
    """
    check_output(config.output, "masks", overwrite=config.overwrite,
                 inputs=[config.artifact, config.model, config.calib])
    source = load_artifact(config.artifact)
    loaded = loaded or load_model(config.model or source.manifest["model"], config.dtype, config.device,
                                  config.trust_remote_code)
    source.check_matches(loaded.model, model_fingerprint(loaded.model))
    lines, description = load_texts(config.calib, split="train")
    blocks = token_blocks(loaded.tokenizer, lines, config.seq_len, config.nsamples, config.seed)
    weights = reconstruct_weights(loaded, source.masks, source.pattern, blocks, progress=config.progress,
                                  damp=config.damp, refine_steps=config.refine_steps, device=config.device,
                                  target=config.target)
    manifest = copy.deepcopy(source.manifest)
    manifest["reconstruction"] = {
        "method": "sparsegpt-obs",
        "target": config.target,
        "calibration": f"{description}; {blocks.shape[0]} blocks x {blocks.shape[1]} tokens",
        "nsamples": int(blocks.shape[0]),
        "seq_len": int(blocks.shape[1]),
        "seed": config.seed,
        "damp": config.damp,
        "refine_steps": config.refine_steps,
        "source": str(config.artifact),
    }
    artifact = MaskArtifact(source.masks, manifest, weights)
    save_artifact(config.output, artifact, _other_files(Path(config.artifact)), overwrite=config.overwrite)
    return artifact


def _other_files(directory: Path) -> list[tuple[str, bytes]]:
    """Top-level files of the source artifact that gmc does not rewrite (logs, hypernetwork, ...)."""
    own = {MASKS_FILE, MANIFEST_FILE, WEIGHTS_FILE, MARKER}
    return [(path.name, path.read_bytes()) for path in sorted(directory.iterdir())
            if path.is_file() and path.name not in own]
