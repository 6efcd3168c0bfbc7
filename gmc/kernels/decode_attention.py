"""``gmc::decode_attention``: one query token's attention over a grouped-query KV cache.

Decode's attention (``gmc.graph.decode.grouped_attention``, one token, CPU) as one op::

    q [B, H, 1, D], k / v [B, H_kv, L, D], mask bool [B or 1, 1, 1, L] or None -> out [B, H, 1, D]
    scores[g, l] = scale * q_g . k_l   (the G = H / H_kv query heads of each KV head; masked: -inf)
    out_g = softmax(scores[g]) @ v     (fp32 inside, out in q's dtype)

Written as torch ops, it was two batched GEMMs and a softmax per layer: MKL's small-matrix path
took ~7 us a call on SmolLM2's shapes, and bf16 GEMMs ran ATen's scalar fallback (~10% of a bf16
decode step). Implementations, by dispatch key:

- CPU: the C++ kernel in ``cpu_group_sparse.cpp`` (same library as ``group_sparse_linear``,
  registered when it loads; compiled packages call its C shim), float32 and bfloat16;
- CompositeExplicitAutograd (before the kernel loads, other dtypes, other devices):
  ``decode_attention_torch``, the same math in torch ops;
- fake: the output shape (the cache length ``L`` may be an unbacked size under export).
"""
from __future__ import annotations

import torch

import gmc.kernels.cpu_group_sparse as cpu_group_sparse

SCHEMA = "decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor"

_lib = torch.library.Library("gmc", "FRAGMENT")
_lib.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))

decode_attention = torch.ops.gmc.decode_attention.default
"""``(q, k, v, mask, scale)`` -> ``[B, H, 1, D]``, shapes as in the module docstring."""


def decode_attention_torch(q, k, v, mask, scale: float) -> torch.Tensor:
    """The op in torch ops, fp32 inside: ``q``'s query heads grouped by KV head (no copy of the cache)."""
    batch, heads, _, dim = q.shape
    rows = q.reshape(batch, k.shape[1], heads // k.shape[1], dim).float()  # [B, H_kv, G, D]
    scores = (rows @ k.float().transpose(-1, -2)) * scale  # [B, H_kv, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).reshape(batch, heads, 1, dim).to(q.dtype)


def _composite(q, k, v, mask, scale):
    # as group_sparse_linear's: the first float32/bfloat16 CPU call loads the C++ kernel, which
    # registers itself for CPU; later calls come here only for what it hands back
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and cpu_group_sparse.load_at_first_call():
        return decode_attention(q, k, v, mask, scale)
    return decode_attention_torch(q, k, v, mask, scale)


def _fake(q, k, v, mask, scale):
    return q.new_empty(q.shape)


_lib.impl("decode_attention", _composite, "CompositeExplicitAutograd")
torch.library.register_fake("gmc::decode_attention", _fake, lib=_lib)
