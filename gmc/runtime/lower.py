"""``gmc lower``: a masks artifact -> a dense HF checkpoint, a lowered directory or an ONNX file.

    load model -> check the artifact against it
      dense:          fold (the FOLD list of gmc.graph.pipeline) -> HF checkpoint + tokenizer
      torch, triton:  lower (pack_targets, then the LOWER list on the logits graph)
                      -> lowered directory: a packed HF checkpoint (gmc.formats.lowered) beside the
                         lowered program (program.pt2); the same files for both (a CUDA load tiles it)
                      --compile (torch): lower_decode (the LOWER list on the prefill and decode programs)
                         -> AOTInductor packages in <out>/compiled (gmc.formats.compiled)
      onnx:           lower -> the lowered program exported to ONNX (gmc.formats.onnx)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from gmc.config import check_at_least
from gmc.errors import GmcError
from gmc.formats import compiled
from gmc.formats.artifact import load_artifact, model_fingerprint
from gmc.formats.atomic import atomic_dir
from gmc.formats.lowered import save_lowered
from gmc.formats.outputs import check_output, output_path
from gmc.graph.pipeline import LowerOptions, fold, lower, lower_decode
from gmc.graph.trace import export_logits
from gmc.groups import NMSpec, Pattern
from gmc.inputs.model import load_model
from gmc.kernels.quantize import QUANTIZE

BACKENDS = ("torch", "triton", "onnx", "dense")


@dataclass
class LowerConfig:
    """What ``gmc lower`` does: which artifact, which backend, where to write."""

    artifact: str
    out: str
    backend: str = "torch"
    onnx_standard_ops: bool = False
    dtype: str = "float32"
    model: Optional[str] = None  # None: the model named in the artifact's manifest
    overwrite: bool = False  # replace an existing output of the same kind that gmc wrote
    trust_remote_code: bool = False
    compile: bool = False  # also AOTInductor-compile prefill/decode programs (gmc.formats.compiled)
    max_len: int = 512  # positions of the compiled programs' static KV cache (attention reads the filled ones)
    quantize: str = "none"  # int8 / int4: packed kept values weight-only (gmc.kernels.quantize.quantize)

    def __post_init__(self):
        self.out = str(output_path(self.out))
        if self.backend not in BACKENDS:
            raise GmcError(f"bad backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.compile and self.backend not in ("torch", "triton"):
            raise GmcError(f"--compile applies to --backend torch or triton, not {self.backend}")
        if self.compile and self.backend == "triton":
            raise GmcError(f"--compile --backend triton is refused: {compiled.CUDA_PACKAGES}")
        check_at_least("--max-len", self.max_len, 2)
        if self.quantize not in QUANTIZE:
            raise GmcError(f"bad --quantize {self.quantize!r}: expected one of {', '.join(QUANTIZE)}")
        if self.quantize != "none" and self.backend not in ("torch", "triton"):
            raise GmcError(f"--quantize {self.quantize} packs the lowered layers: use --backend torch or triton, "
                           f"not {self.backend}")
        if self.onnx_standard_ops and self.backend != "onnx":
            raise GmcError("--onnx-standard-ops only applies to --backend onnx")

    @property
    def kind(self) -> str:
        """The output kind (``gmc.formats.outputs``): what ``--overwrite`` may replace at ``out``."""
        return {"onnx": "onnx", "dense": "dense"}.get(self.backend, "lowered")


def check_backend(backend: str, pattern: Pattern) -> None:
    """Refuse what a backend cannot run, naming what it can."""
    if backend == "dense":
        return
    if isinstance(pattern, NMSpec):
        raise GmcError(
            f"backend {backend} cannot lower N:M pattern {pattern}: packed lowering supports group patterns "
            "(GOUTxGIN such as 1x256, 1x64, 32x32); fold N:M masks into a dense checkpoint with --backend dense"
        )
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError as error:
            raise GmcError("--backend triton needs the triton package and a CUDA GPU; "
                           "use the CPU fallback --backend torch") from error
        if not torch.cuda.is_available():
            raise GmcError("--backend triton needs a CUDA GPU (none found); use the CPU fallback --backend torch")


@dataclass(frozen=True)
class LowerResult:
    path: Path
    packed_bytes: int  # target weights as stored: kept values + indices (dense: the dense bytes)
    dense_bytes: int  # the same targets stored dense


def lower_artifact(config: LowerConfig) -> LowerResult:
    """Masks artifact -> HF checkpoint (dense), lowered directory (torch, triton) or ONNX file."""
    check_output(config.out, config.kind, overwrite=config.overwrite, inputs=[config.artifact, config.model])
    artifact = load_artifact(config.artifact)
    pattern = artifact.pattern
    check_backend(config.backend, pattern)
    loaded = load_model(config.model or artifact.manifest["model"], dtype=config.dtype,
                        trust_remote_code=config.trust_remote_code)
    artifact.check_matches(loaded.model, model_fingerprint(loaded.model))
    if config.backend == "dense":
        fold(loaded.model, artifact.masks, pattern, artifact.weights, in_place=True)
        weights = (loaded.model.get_submodule(name).weight for name in artifact.masks)
        dense = sum(weight.numel() * weight.element_size() for weight in weights)
        with atomic_dir(config.out, "dense", config.overwrite) as tmp:
            loaded.model.save_pretrained(tmp)
            if loaded.tokenizer is not None and hasattr(loaded.tokenizer, "save_pretrained"):
                loaded.tokenizer.save_pretrained(tmp)
        return LowerResult(Path(config.out), dense, dense)

    options = LowerOptions(quantize=config.quantize)
    gm, packed = lower(loaded.model, artifact.masks, pattern, artifact.weights, options)
    targets = (loaded.model.get_submodule(name).weight for name in packed)
    sizes = (sum(p.nbytes for p in packed.values()), sum(w.numel() * w.element_size() for w in targets))
    if config.backend == "onnx":
        from gmc.formats.onnx import export_onnx  # imports onnx and onnxscript

        program = export_logits(gm, int(loaded.model.config.vocab_size))
        return LowerResult(export_onnx(program, config.out, standard_ops=config.onnx_standard_ops), *sizes)
    manifest = {key: artifact.manifest[key] for key in ("model", "group", "method", "global_sparsity")
                if key in artifact.manifest}
    manifest.update(backend=config.backend, source_artifact=str(config.artifact), quantize=config.quantize)
    programs = None
    if config.compile:
        programs = lower_decode(loaded.model, packed, config.max_len, options)
    with atomic_dir(config.out, "lowered", config.overwrite) as tmp:
        save_lowered(tmp, loaded.model, loaded.tokenizer, packed, manifest, program=gm)
        if programs is not None:
            compiled.compile_programs(programs, tmp, config.max_len)
    return LowerResult(Path(config.out), *sizes)
