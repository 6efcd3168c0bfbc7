"""``gmc lower``: the lowering stage's entry point, a masks artifact in, the backend's output out.

    check the options and the output path -> load the artifact -> the backend checks its pattern
      -> load the base model -> check the artifact was made from it -> the backend writes

With ``--group`` the input is a HF checkpoint pruned elsewhere, and the artifact is read from its
all-zero groups once it is loaded (``gmc.lower.from_zeros``).

The backends (``gmc.lower.backends``) hold what differs; this module holds what every lowering
shares: the options, the order of the checks, the loading.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from gmc.config import (
    base_model_option,
    check_at_least,
    device_option,
    dtype_option,
    option,
    output_option,
    overwrite_option,
    passed,
    trust_remote_code_option,
)
from gmc.errors import GmcError
from gmc.formats.artifact import load_artifact, model_fingerprint
from gmc.formats.outputs import check_output, output_path
from gmc.groups import parse_pattern
from gmc.inputs.model import AUTO, auto_device, device_and_dtype, load_model
from gmc.kernels.quantize import QUANTIZE
from gmc.lower.backend import Backend, LowerResult, Steps
from gmc.lower.backends import ALIASES, BACKEND_HELP, BACKENDS
from gmc.lower.from_zeros import artifact_from_zeros, check_source


@dataclass
class LowerConfig:
    """What ``gmc lower`` does: which artifact, which backend for which device, where to write."""

    artifact: str
    output: Optional[str] = output_option("Output directory.")
    backend: str = option("packed", BACKEND_HELP, choices=(*BACKENDS, *ALIASES))
    device: str = device_option()  # where the output will run: the backend's kernels and auto's dtype
    dtype: str = dtype_option("Dtype of the stored weights; auto: bfloat16 for CUDA, float32 for the CPU.")
    model: Optional[str] = base_model_option()
    overwrite: bool = overwrite_option()
    trust_remote_code: bool = trust_remote_code_option()
    quantize: str = option("none", "packed, onnx: kept values weight-only int8 (a scale per kept group column) or int4 "
                                   "(two codes a byte, an fp16 scale and offset per 32 weights of a column).",
                           choices=QUANTIZE)
    compile: bool = option(False, "packed, CPU: also export prefill and decode programs over a static KV cache "
                                  "and compile them ahead of time (AOTInductor) into <output>/compiled; "
                                  "`gmc generate <output>` runs them.")
    max_len: int = option(512, "With --compile: KV cache positions (prompt + generated tokens) of the programs.")
    onnx_standard_ops: bool = option(False, "onnx: standard ONNX ops (any ONNX Runtime opens them) instead of "
                                            "the gmc.GroupSparseLinear op and its library.")
    group: Optional[str] = option(None, "ARTIFACT is a HF checkpoint pruned elsewhere (Wanda, SparseGPT, "
                                        "llm-compressor): its all-zero GOUTxGIN groups (1x64, 32x32) are the masks, "
                                        "its other weights are kept as they are.")
    zero_tolerance: float = option(0.01, "With --group: the share of the zero weights that may lie outside "
                                         "all-zero groups; above it the zeros do not form --group: refused.")
    progress: bool = True  # a bar of the stage's steps on stderr (gmc lower --quiet: off)

    def __post_init__(self):
        if self.output is None:
            raise GmcError("lower needs an output path: -o/--output")
        self.output = str(output_path(self.output))
        check_source(self)  # a HF checkpoint needs --group, a masks artifact refuses it
        alias = None
        if self.backend in ALIASES:
            alias, (self.backend, device) = self.backend, ALIASES[self.backend]
            if self.device not in (AUTO, device) and not self.device.startswith(f"{device}:"):
                raise GmcError(f"--backend {alias} is the {self.backend} backend for --device {device}, not "
                               f"--device {self.device}: use --backend {self.backend} --device {self.device}")
            self.device = device if self.device == AUTO else self.device
        if self.backend not in BACKENDS:
            raise GmcError(f"bad --backend {self.backend!r}: expected one of {', '.join([*BACKENDS, *ALIASES])}")
        check_at_least("--max-len", self.max_len, 2)
        if self.quantize not in QUANTIZE:
            raise GmcError(f"bad --quantize {self.quantize!r}: expected one of {', '.join(QUANTIZE)}")
        _refuse_other_backends_options(self, self.chosen)
        self.device = auto_device(self.device)
        self.chosen.check(self)  # what the backend refuses for this device, before asking for the device
        try:
            self.device, self.dtype = device_and_dtype(self.device, self.dtype)
        except GmcError as error:
            raise GmcError(f"--backend {alias} lowers for {self.device}: {error}" if alias else str(error)) from None

    @property
    def chosen(self) -> Backend:
        return BACKENDS[self.backend]


def _refuse_other_backends_options(config: LowerConfig, backend: Backend) -> None:
    """An option that only another backend reads, set away from its default, is an error, not a no-op."""
    others = {name for other in BACKENDS.values() for name in other.options} - set(backend.options)
    given = passed(config, [f.name for f in dataclasses.fields(config) if f.name in others])
    if not given:
        return
    name, value = given[0], getattr(config, given[0])
    spelled = f"--{name.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
    users = ", ".join(b.name for b in BACKENDS.values() if name in b.options)
    raise GmcError(f"{spelled} applies to --backend {users}, not {backend.name}")


def lower_artifact(config: LowerConfig) -> LowerResult:
    """The masks artifact of ``config`` lowered by its backend, written at ``config.output``."""
    backend = config.chosen
    check_output(config.output, backend.kind, overwrite=config.overwrite, inputs=[config.artifact, config.model])
    artifact = None if config.group else load_artifact(config.artifact)  # --group: masks from the zeros, below
    if artifact is not None:
        backend.check_pattern(artifact.pattern)
    with Steps(1 + backend.steps(config), f"gmc lower ({backend.name})", config.progress) as steps:
        steps("loading the model")
        # lowering itself runs on the host: the output is the same files for every device it targets
        loaded = load_model(config.model or (artifact.manifest["model"] if artifact else config.artifact),
                            dtype=config.dtype, trust_remote_code=config.trust_remote_code)
        if artifact is None:  # made from this model: its fingerprint is the model's by construction
            artifact = artifact_from_zeros(loaded, parse_pattern(config.group), config.zero_tolerance)
        else:
            artifact.check_matches(loaded.model, model_fingerprint(loaded.model))
        return backend.write(config, artifact, loaded, steps)
