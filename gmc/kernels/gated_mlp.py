"""``gmc::group_sparse_gated_mlp``: a gated MLP's two group-sparse products as one op.

What ``gmc.graph.passes.fuse_gated_mlp`` puts in place of a lowered decoder layer's MLP once
``fuse_siblings`` has made its gate and up projections one op::

    h = group_sparse_linear(x, values, row_idx, row_ptr, bias, 2 * d_ff, g_in, scales)  # [..., gate | up]
    y = group_sparse_linear(silu(h[..., :d_ff]) * h[..., d_ff:], down_values, down_row_idx,
                            down_row_ptr, down_bias, d_out, g_in, down_scales)

Why: a compiled SmolLM2 decode step on two threads spends ~2.3 ms of fixed costs that are the
same for every model, sparse or not, beside ~3-6 ms of streaming weights (docs/lowering.md);
each op call carries its own (the shim, checks, the output, a fork and join) and
the activation between the two products was a kernel of its own with a fork of its own. One call
per MLP does both products and the activation, with ``h`` in fp32 scratch.

Implementations, by dispatch key:

- CPU: the C++ kernel in ``cpu_group_sparse.cpp`` (same library as ``group_sparse_linear``,
  registered when it loads; compiled packages call its C shim), float32 and bfloat16 ``x`` with
  values of ``x``'s dtype or int8 with scales; ``h`` and the activation stay fp32 inside;
- CompositeExplicitAutograd (before the kernel loads, other dtypes, other devices, CUDA's Triton
  kernels included): ``gated_mlp_torch``, the two ``group_sparse_linear`` calls and the activation
  in ``x``'s dtype, as the unfused graph computes them; on CUDA Inductor traces the op into the same
  (``inline_on_cuda``), so a compiled CUDA program holds the two products' Triton kernels;
- fake: the output shape.
"""
from __future__ import annotations

import torch

import gmc.kernels.cpu_group_sparse as cpu_group_sparse
from gmc.kernels.group_sparse_linear import group_sparse_linear
from gmc.kernels.inline_on_cuda import inline_on_cuda

SCHEMA = ("group_sparse_gated_mlp(Tensor x, Tensor values, Tensor row_idx, Tensor row_ptr, Tensor? bias, "
          "Tensor down_values, Tensor down_row_idx, Tensor down_row_ptr, Tensor? down_bias, int d_ff, int d_out, "
          "int g_in, Tensor? scales=None, Tensor? down_scales=None) -> Tensor")

_lib = torch.library.Library("gmc", "FRAGMENT")
_lib.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))

group_sparse_gated_mlp = torch.ops.gmc.group_sparse_gated_mlp.default
"""``x [..., d_in]`` -> ``[..., d_out]``; each layer's tensors as ``group_sparse_linear`` takes them."""


def gated_mlp_torch(x, values, row_idx, row_ptr, bias, down_values, down_row_idx, down_row_ptr, down_bias,
                    d_ff: int, d_out: int, g_in: int, scales=None, down_scales=None) -> torch.Tensor:
    """The op as the unfused graph runs it: two ``group_sparse_linear`` calls, silu and product in ``x``'s dtype."""
    h = group_sparse_linear(x, values, row_idx, row_ptr, bias, 2 * d_ff, g_in, scales)
    gate, up = h.split(d_ff, dim=-1)
    hidden = torch.nn.functional.silu(gate) * up
    return group_sparse_linear(hidden, down_values, down_row_idx, down_row_ptr, down_bias, d_out, g_in, down_scales)


def _composite(x, values, row_idx, row_ptr, bias, down_values, down_row_idx, down_row_ptr, down_bias, d_ff, d_out,
               g_in, scales=None, down_scales=None):
    # as group_sparse_linear's: the first float32/bfloat16 CPU call loads the C++ kernel, which
    # registers itself for CPU; later calls come here only for what it hands back
    args = (x, values, row_idx, row_ptr, bias, down_values, down_row_idx, down_row_ptr, down_bias, d_ff, d_out, g_in,
            scales, down_scales)
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and cpu_group_sparse.load_at_first_call()):
        return group_sparse_gated_mlp(*args)
    return gated_mlp_torch(*args)


def _fake(x, values, row_idx, row_ptr, bias, down_values, down_row_idx, down_row_ptr, down_bias, d_ff, d_out, g_in,
          scales=None, down_scales=None):
    return x.new_empty((*x.shape[:-1], d_out))


_lib.impl("group_sparse_gated_mlp", _composite, "CompositeExplicitAutograd")
torch.library.register_fake("gmc::group_sparse_gated_mlp", _fake, lib=_lib)
inline_on_cuda("gmc::group_sparse_gated_mlp", _lib, gated_mlp_torch)
