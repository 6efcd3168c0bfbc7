"""``--backend packed``: a packed HF checkpoint (``gmc.formats.lowered``) beside the lowered program.

    pack_targets -> the LOWER pass list on the logits graph -> model.safetensors + program.pt2
    [--compile: the LOWER list on the prefill and decode programs -> AOTInductor packages]

The files are the same for either device: ``from_pretrained`` builds ``GroupSparseLinear`` modules,
which run gmc's C++ kernel on the CPU and tile themselves for the Triton kernel when moved to CUDA.
``--device`` states where the output will run: the dtype ``auto`` picks and what is checked here
(CUDA and Triton for cuda; ``--compile`` builds CPU packages only).
"""
from __future__ import annotations

from pathlib import Path

from gmc.errors import GmcError
from gmc.formats.atomic import atomic_dir
from gmc.formats.compiled import CUDA_PACKAGES
from gmc.formats.lowered import save_lowered
from gmc.graph.pipeline import LowerOptions, lower, lower_decode
from gmc.lower.backend import PROVENANCE, Backend, LowerResult, device_type, target_bytes

# copied from the artifact's manifest: what ``gmc info`` shows of where a lowered model came from


class PackedBackend(Backend):
    name = "packed"
    help = "a packed group-sparse HF checkpoint + the lowered program (gmc's CPU and CUDA ops)"
    kind = "lowered"
    devices = ("cpu", "cuda")
    options = ("quantize", "compile", "max_len")

    def check(self, config) -> None:
        super().check(config)
        if device_type(config.device) != "cuda":
            return
        if config.compile:
            raise GmcError(f"--compile builds CPU packages; for --device cuda it is refused: {CUDA_PACKAGES}")
        try:
            import triton  # noqa: F401
        except ImportError as error:
            raise GmcError("--device cuda lowers for gmc's Triton op: install triton (pip install triton)") from error

    def steps(self, config) -> int:
        return 4 if config.compile else 2

    def write(self, config, artifact, loaded, steps) -> LowerResult:
        options = LowerOptions(quantize=config.quantize)
        steps("packing and lowering")
        gm, packed = lower(loaded.model, artifact.masks, artifact.pattern, artifact.weights, options)
        sizes = sum(p.nbytes for p in packed.values()), target_bytes(loaded.model, packed)
        manifest = {key: artifact.manifest[key] for key in PROVENANCE if key in artifact.manifest}
        manifest.update(backend=self.name, device=config.device, source_artifact=str(config.artifact),
                        quantize=config.quantize)
        if config.compile:
            steps("exporting the prefill and decode programs")
            programs = lower_decode(loaded.model, packed, config.max_len, options)
        with atomic_dir(config.output, self.kind, config.overwrite) as tmp:
            steps("saving the packed checkpoint and program")
            save_lowered(tmp, loaded.model, loaded.tokenizer, packed, manifest, program=gm)
            if config.compile:
                from gmc.lower.compile import compile_programs

                steps("compiling (AOTInductor)")
                compile_programs(programs, tmp, config.max_len)
        return LowerResult(Path(config.output), *sizes)
