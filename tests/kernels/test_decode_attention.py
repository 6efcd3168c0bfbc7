"""gmc::decode_attention: the C++ kernel and the torch implementation against SDPA over the cache
repeated per query head (HF's own path), fp32 tight and bf16 relative; what it does not compile
goes to the torch implementation."""
import pytest
import torch
import torch.nn.functional as F

from gmc.kernels import decode_attention as op_module
from gmc.kernels.decode_attention import decode_attention, decode_attention_torch


@pytest.fixture
def torch_calls(count_calls):
    """Counts the calls of the op's torch implementation."""
    return count_calls(op_module, "decode_attention_torch")


def _case(batch, heads, kv_heads, length, dim, dtype, seed=0, cache=None):
    """q, the filled slots of a cache of ``cache`` slots (a narrowed view, as decode passes them), a mask."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads, dim, generator=gen).to(dtype).transpose(1, 2)  # [B, H, 1, D], as q_proj gives it
    slots = cache or length
    k = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype).narrow(2, 0, length)
    v = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype).narrow(2, 0, length)
    mask = torch.rand(batch, 1, 1, length, generator=gen) > 0.3
    mask[..., 0] = True
    return q, k, v, mask


def _reference(q, k, v, mask, scale):
    groups = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(groups, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,kv_heads,length,dim", [
    (1, 9, 3, 1, 64),     # SmolLM2, first position
    (1, 9, 3, 77, 64),    # SmolLM2
    (2, 8, 8, 33, 40),    # no grouping; D = 40: five of the output's eight register vectors (AVX2)
    (1, 6, 2, 13, 36),    # D = 36: a scalar tail past the last whole vector; 13 keys: 4 + 4 + 4 + 1
    (1, 32, 8, 300, 128), # LLaMA-3-like grouping, long cache
])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_attention_over_the_repeated_cache(kernel, torch_calls, dtype, batch, heads, kv_heads, length,
                                                          dim, masked, threads):
    """On two threads the query heads split in ranges: SmolLM2's 9 at 77 slots 5 / 4, cutting a KV
    head's 3 query heads 2 / 1; the batch of 2 one row per thread."""
    q, k, v, mask = _case(batch, heads, kv_heads, length, dim, dtype, cache=length + 5)
    mask = mask if masked else None
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = decode_attention(q, k, v, mask, dim ** -0.5)
    finally:
        torch.set_num_threads(saved)
    assert out.dtype == dtype and out.shape == (batch, heads, 1, dim) and torch_calls == []
    expected = _reference(q, k, v, mask, dim ** -0.5)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    torch.testing.assert_close(decode_attention_torch(q, k, v, mask, dim ** -0.5).float(), expected, **tolerance)


def test_slots_past_the_length_are_never_read(kernel):
    q, k, v, mask = _case(1, 9, 3, 20, 64, torch.float32, cache=20)
    full_k, full_v = (torch.cat([t, torch.full((1, 3, 12, 64), float("nan"))], dim=2) for t in (k, v))
    out = decode_attention(q, full_k.narrow(2, 0, 20), full_v.narrow(2, 0, 20), mask, 0.125)
    torch.testing.assert_close(out, decode_attention_torch(q, k, v, mask, 0.125))


def test_a_fully_masked_row_is_nan_as_in_torch(kernel):
    q, k, v, mask = _case(1, 4, 2, 6, 16, torch.float32)
    out = decode_attention(q, k, v, torch.zeros_like(mask), 0.25)
    assert out.isnan().all()


@pytest.mark.parametrize("bad", ["float16", "two_tokens", "strided_dim", "mask_shape"])
def test_inputs_the_kernel_does_not_compile_take_the_torch_path(kernel, torch_calls, bad):
    q, k, v, mask = _case(1, 4, 2, 6, 16, torch.float32)
    if bad == "float16":
        q, k, v = q.half(), k.half(), v.half()
    elif bad == "two_tokens":
        q = torch.cat([q, q], dim=2)
    elif bad == "strided_dim":
        k = torch.randn(1, 2, 6, 32)[..., ::2]
    else:
        mask = mask.expand(1, 4, 1, 6)
    if bad in ("float16", "strided_dim"):
        out = decode_attention(q, k, v, mask, 0.25)
        assert torch_calls == [1]
        torch.testing.assert_close(out.float(), _reference(q, k, v, mask, 0.25), atol=2e-3, rtol=2e-3)
    else:  # shapes the torch implementation does not run either: one line from torch, no crash
        with pytest.raises(RuntimeError):
            decode_attention(q, k, v, mask, 0.25)
        assert torch_calls == [1]
