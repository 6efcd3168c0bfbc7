"""``--backend onnx``: the lowered logits program exported to an ONNX file (``gmc.formats.onnx``).

Each group-sparse op becomes the ``gmc::GroupSparseLinear`` custom op, or with
``--onnx-standard-ops`` a composition of standard ONNX ops that any runtime opens.
"""
from __future__ import annotations

from gmc.graph.pipeline import LowerOptions, lower
from gmc.graph.trace import export_logits
from gmc.lower.backend import Backend, LowerResult, target_bytes


class OnnxBackend(Backend):
    name = "onnx"
    help = "an .onnx file of the lowered program"
    kind = "onnx"
    options = ("onnx_standard_ops",)

    def steps(self, config) -> int:
        return 3

    def write(self, config, artifact, loaded, steps) -> LowerResult:
        from gmc.formats.onnx import export_onnx  # imports onnx and onnxscript

        steps("packing and lowering")
        gm, packed = lower(loaded.model, artifact.masks, artifact.pattern, artifact.weights, LowerOptions())
        steps("exporting the program")
        program = export_logits(gm, int(loaded.model.config.vocab_size))
        steps("exporting to ONNX")
        path = export_onnx(program, config.output, standard_ops=config.onnx_standard_ops)
        return LowerResult(path, sum(p.nbytes for p in packed.values()), target_bytes(loaded.model, packed))
