"""``gmc::attention_block``: a decoder layer's attention for one token, from the q/k/v product to the o product.

What ``gmc.graph.passes.fuse_attention`` puts in place of that subgraph of an exported decode step
(one token, CPU, float32)::

    qkv = group_sparse_linear(x, qkv_values, ..., (H + 2 H_kv) D, g_in, qkv_scales)     # q | k | v
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin               # HF's rope
    keys.index_copy_(2, index, k); values.index_copy_(2, index, v)                       # the cache, in place
    a = decode_attention(q, keys[:, :, :length], values[:, :, :length], mask, scale)
    y = group_sparse_linear(a.transpose(1, 2).reshape(..., H D), o_values, ..., d_out, g_in, o_scales)

``keys`` / ``values`` are the layer's cache ``[1, H_kv, M, D]`` (written at slot ``index``),
``cos`` / ``sin`` the token's rotary factors (``D`` numbers, as the graph computed them), ``length``
the filled slots attention reads.

Why: per SmolLM2 layer this was two op calls, the rope's generated kernel and about ten views,
buffers and tensor handles between them, all on the calling thread while the other threads of a
two-thread step wait (docs/lowering.md, "Why compiled decode is built this way").

Implementations, by dispatch key:

- CPU: the C++ kernel in ``cpu_group_sparse.cpp`` (same library as ``group_sparse_linear``,
  registered when it loads; compiled packages call its C shim): float32 x of one token over a
  float32 batch-1 cache, with the products and the attention of the ops it replaces;
- CompositeExplicitAutograd (before the kernel loads, other inputs, other devices):
  ``attention_block_torch``, the replaced subgraph in torch ops;
- fake: the output shape.
"""
from __future__ import annotations

import torch

import gmc.kernels.cpu_group_sparse as cpu_group_sparse
from gmc.kernels.decode_attention import decode_attention
from gmc.kernels.group_sparse_linear import group_sparse_linear

SCHEMA = ("attention_block(Tensor x, Tensor qkv_values, Tensor qkv_row_idx, Tensor qkv_row_ptr, Tensor? qkv_bias, "
          "Tensor cos, Tensor sin, Tensor index, Tensor(a!) keys, Tensor(b!) values, SymInt length, Tensor? mask, "
          "float scale, Tensor o_values, Tensor o_row_idx, Tensor o_row_ptr, Tensor? o_bias, int heads, int d_out, "
          "int g_in, Tensor? qkv_scales=None, Tensor? o_scales=None) -> Tensor")

_lib = torch.library.Library("gmc", "FRAGMENT")
_lib.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))

attention_block = torch.ops.gmc.attention_block.default
"""``x [..., d_in]`` -> ``[..., d_out]``, the cache written in place; arguments as in the module docstring."""


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def attention_block_torch(x, qkv_values, qkv_row_idx, qkv_row_ptr, qkv_bias, cos, sin, index, keys, values,
                          length, mask, scale: float, o_values, o_row_idx, o_row_ptr, o_bias, heads: int, d_out: int,
                          g_in: int, qkv_scales=None, o_scales=None) -> torch.Tensor:
    """The op as the unfused decode graph computes it, in torch ops."""
    kv_heads, dim = keys.shape[1], keys.shape[3]
    qkv = group_sparse_linear(x, qkv_values, qkv_row_idx, qkv_row_ptr, qkv_bias, (heads + 2 * kv_heads) * dim, g_in,
                              qkv_scales)
    lead = qkv.shape[:-1]  # [B, T]
    q, k, v = (part.reshape(*lead, -1, dim).transpose(1, 2)
               for part in qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1))
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    keys.index_copy_(2, index, k)
    values.index_copy_(2, index, v)
    out = decode_attention(q, keys.narrow(2, 0, length), values.narrow(2, 0, length), mask, scale)
    return group_sparse_linear(out.transpose(1, 2).reshape(*lead, heads * dim), o_values, o_row_idx, o_row_ptr,
                               o_bias, d_out, g_in, o_scales)


def _composite(x, qkv_values, qkv_row_idx, qkv_row_ptr, qkv_bias, cos, sin, index, keys, values, length, mask, scale,
               o_values, o_row_idx, o_row_ptr, o_bias, heads, d_out, g_in, qkv_scales=None, o_scales=None):
    # as group_sparse_linear's: the first float32 CPU call loads the C++ kernel, which registers
    # itself for CPU; later calls come here only for what it hands back
    args = (x, qkv_values, qkv_row_idx, qkv_row_ptr, qkv_bias, cos, sin, index, keys, values, length, mask, scale,
            o_values, o_row_idx, o_row_ptr, o_bias, heads, d_out, g_in, qkv_scales, o_scales)
    if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_group_sparse.load_at_first_call():
        return attention_block(*args)
    return attention_block_torch(*args)


def _fake(x, qkv_values, qkv_row_idx, qkv_row_ptr, qkv_bias, cos, sin, index, keys, values, length, mask, scale,
          o_values, o_row_idx, o_row_ptr, o_bias, heads, d_out, g_in, qkv_scales=None, o_scales=None):
    return x.new_empty((*x.shape[:-1], d_out))


_lib.impl("attention_block", _composite, "CompositeExplicitAutograd")
torch.library.register_fake("gmc::attention_block", _fake, lib=_lib)
