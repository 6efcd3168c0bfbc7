"""ONNX files: the lowered logits program exported with each op translated (``gmc.kernels.onnx_group_sparse``)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from gmc.errors import GmcError
from gmc.kernels.gated_mlp import group_sparse_gated_mlp
from gmc.kernels.group_sparse_linear import group_sparse_linear
from gmc.kernels.onnx_group_sparse import QUANTIZED_REFUSED, translation_table


def export_onnx(program: torch.export.ExportedProgram, path: str | os.PathLike, standard_ops: bool = False) -> Path:
    """Export the ``input_ids -> logits`` program of a lowered graph (``gmc.graph.trace.export_logits``
    of what ``lower_group_sparse`` made) to ONNX at ``path``.

    Dynamic batch and sequence length. Weights go to ``<name>.data`` next to the file when the
    model exceeds protobuf's 2 GB limit. Written in a temporary directory, then renamed.
    """
    path = Path(path)
    try:
        ops = [node for node in program.graph.nodes if node.target in (group_sparse_linear, group_sparse_gated_mlp)]
        if not ops:
            raise GmcError("export_onnx needs a lowered program: it has no gmc::group_sparse_linear op")
        if any(getattr(arg.meta.get("val"), "dtype", None) in (torch.int8, torch.uint8)  # weight-only int8 / int4
               for node in ops for arg in node.args if isinstance(arg, torch.fx.Node)):
            raise GmcError(QUANTIZED_REFUSED)
        # optimize=False: onnxscript's optimizer (rewrite-rule matching over every node) took 68 of the
        # 99 s of SmolLM2's export, and with standard ops it did not finish in 13 minutes (36 s without);
        # onnxruntime runs its own graph optimizations when it opens the file (the custom-op file ran as fast)
        with torch.no_grad():
            onnx_program = torch.onnx.export(program, dynamo=True, optimize=False,
                                             custom_translation_table=translation_table(standard_ops),
                                             input_names=["input_ids"], output_names=["logits"], verbose=False)
    except GmcError:
        raise
    except Exception as error:  # the exporter raises many types; report the first line
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise GmcError(f"ONNX export failed: {first}") from error
    onnx_program.model.metadata_props["gmc_output"] = "onnx"  # lets `gmc lower --overwrite` recognise it
    size = sum(t.numel() * t.element_size() for t in [*program.state_dict.values(), *program.constants.values()]
               if isinstance(t, torch.Tensor))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.tmp-{os.getpid()}-") as tmp:
        onnx_program.save(Path(tmp) / path.name, external_data=size > (1800 << 20))
        for produced in Path(tmp).iterdir():
            os.replace(produced, path.parent / produced.name)
    return path
