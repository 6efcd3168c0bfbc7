"""ONNX export of ``gmc::group_sparse_linear`` and its onnxruntime implementation.

Two translations, chosen at export time:

- custom op (default): one ``gmc::GroupSparseLinear`` node per target (domain ``gmc``, version 1)
  with inputs ``(x, values, row_idx, row_ptr, bias)`` and attributes ``d_out``, ``g_in``; the packed
  tensors are initializers. ``register_onnxruntime_op`` defines its onnxruntime implementation
  as an onnxruntime-extensions Python op (float32), so ``onnxruntime_session`` runs the file in
  the process that registered it. Emitted with ``torch.onnx.ops.symbolic`` while
  ``torch.onnx.is_in_onnx_export()`` (DESIGN.md section 10).
- standard ops (``standard_ops=True``): the same algorithm written with standard ONNX ops that any
  runtime loads: per input block a ``Slice`` of ``x`` and a ``MatMul`` with that block's packed
  ``[w_v, R_v]`` values, a ``Concat`` of the block outputs ``[..., R]`` and one
  ``ScatterElements(reduction="add")`` into ``[..., d_out]``; still only kept weights are stored.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch

from gmc.errors import GmcError
from gmc.trace import LogitsOnly

ONNX_OP = "gmc::GroupSparseLinear"


def onnx_group_sparse_linear(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int, blocks, standard_ops: bool):
    """Called from ``GroupSparseLinear.forward`` during ONNX export; ``blocks`` are python
    ``(row_start, n_rows, width)`` triples (static per layer) for the standard-op decomposition."""
    if bias is None:
        bias = x.new_zeros(d_out)
    if not standard_ops:
        return torch.onnx.ops.symbolic(
            ONNX_OP,
            [x, values, row_idx.to(torch.int32), row_ptr, bias],
            attrs={"d_out": d_out, "g_in": g_in},
            dtype=x.dtype,
            shape=[*x.shape[:-1], d_out],
            version=1,
        )
    outputs = []
    for v, (start, n_rows, width) in enumerate(blocks):
        if n_rows == 0:
            continue
        block = values[start * g_in : start * g_in + width * n_rows].reshape(width, n_rows)  # [w_v, R_v]
        outputs.append(x[..., v * g_in : v * g_in + width] @ block)  # [..., R_v]
    out = bias.expand(*x.shape[:-1], d_out)  # [..., d_out]
    if not outputs:
        return out.clone()
    y = torch.cat(outputs, dim=-1)  # [..., R]
    index = row_idx.long().expand(*x.shape[:-1], row_idx.numel())  # [..., R]
    return out.scatter_add(-1, index, y)


def group_sparse_linear_numpy(x, values, row_idx, row_ptr, bias, d_out: int, g_in: int) -> np.ndarray:
    """NumPy implementation used by onnxruntime: one matmul per input block.

    Within a block each output row appears once, so the fancy-indexed ``+=`` needs no ``add.at``.
    """
    d_in = x.shape[-1]
    x2 = x.reshape(-1, d_in)  # [T, d_in]
    out = np.zeros((x2.shape[0], d_out), dtype=x.dtype)  # [T, d_out]
    for v in range(len(row_ptr) - 1):
        start, n_rows = int(row_ptr[v]), int(row_ptr[v + 1] - row_ptr[v])
        if n_rows == 0:
            continue
        width = min(g_in, d_in - v * g_in)
        block = values[start * g_in : start * g_in + width * n_rows].reshape(width, n_rows)  # [w_v, R_v]
        out[:, row_idx[start : start + n_rows]] += x2[:, v * g_in : v * g_in + width] @ block
    out += bias
    return out.reshape(*x.shape[:-1], d_out)


@functools.cache
def register_onnxruntime_op() -> str:
    """Define the onnxruntime-extensions op once; return the custom-op library path."""
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError as error:
        raise GmcError("running gmc::GroupSparseLinear needs onnxruntime-extensions: "
                       "pip install onnxruntime-extensions (or export with --onnx-standard-ops)") from error

    @onnx_op(
        op_type=ONNX_OP,
        inputs=[PyCustomOpDef.dt_float, PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32,
                PyCustomOpDef.dt_int32, PyCustomOpDef.dt_float],
        outputs=[PyCustomOpDef.dt_float],
        attrs={"d_out": PyCustomOpDef.dt_int64, "g_in": PyCustomOpDef.dt_int64},
    )
    def _group_sparse_linear(x, values, row_idx, row_ptr, bias, d_out, g_in):
        return group_sparse_linear_numpy(x, values, row_idx, row_ptr, bias, d_out, g_in)

    return get_library_path()


def onnxruntime_session(path: str | os.PathLike):
    """An ``InferenceSession`` for a gmc ONNX file: custom op registered, CUDA used if present."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.register_custom_ops_library(register_onnxruntime_op())
    available = ort.get_available_providers()
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    return ort.InferenceSession(str(Path(path)), options, providers=providers)


def export_onnx(model: torch.nn.Module, path: str | os.PathLike, standard_ops: bool = False) -> Path:
    """Export a lowered eager model (``swap_group_sparse_linears`` ran) to ONNX at ``path``.

    Dynamic batch and sequence length. Weights go to ``<name>.data`` next to the file when the
    model exceeds protobuf's 2 GB limit. Written in a temporary directory, then renamed.
    """
    import tempfile

    from gmc.lowered import GroupSparseLinear

    path = Path(path)
    lowered = [m for m in model.modules() if isinstance(m, GroupSparseLinear)]
    if not lowered:
        raise GmcError("export_onnx needs a lowered model: no GroupSparseLinear modules found")
    for module in lowered:
        module.onnx_standard_ops = standard_ops
    vocab = int(getattr(model.config, "vocab_size", 2))
    device = lowered[0].values.device
    example = torch.randint(0, vocab, (2, 8), device=device)  # sizes 0 and 1 would be specialised
    dynamic = {"input_ids": {0: torch.export.Dim("batch", min=1, max=1024), 1: torch.export.Dim("seq", min=2, max=1 << 16)}}
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    try:
        with torch.no_grad():
            program = torch.onnx.export(
                LogitsOnly(model), (example,), dynamo=True, dynamic_shapes=dynamic,
                input_names=["input_ids"], output_names=["logits"], verbose=False,
            )
    except Exception as error:  # the exporter raises many types; report the first line
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise GmcError(f"ONNX export of {type(model).__name__} failed: {first}") from error
    program.model.metadata_props["gmc_output"] = "onnx"  # lets `gmc lower --overwrite` recognise it
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.tmp-{os.getpid()}-") as tmp:
        program.save(Path(tmp) / path.name, external_data=size > (1800 << 20))
        for produced in Path(tmp).iterdir():
            os.replace(produced, path.parent / produced.name)
    return path
