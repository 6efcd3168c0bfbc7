"""gmc::attention_block: the CPU kernel against the op's torch implementation (the unfused
subgraph in torch ops), bit for bit, with the cache written in place."""
import pytest
import torch
from conftest import random_masks, tiny_model

from gmc.graph.pipeline import pack_targets
from gmc.groups import parse_pattern
from gmc.kernels.attention_block import attention_block, attention_block_torch
from gmc.kernels.cpu_group_sparse import kernel
from gmc.kernels.packed import KernelInputs, concat_outputs
from gmc.kernels.quantize import quantize

pytestmark = pytest.mark.skipif(kernel() is None, reason="no C++ compiler: the kernel is the torch path")

HEADS, KV_HEADS, MAX_LEN = 4, 2, 12  # tiny_model's attention
# head dim: 16 as tiny_model's; 64 (hidden 256) makes both products big enough to split over threads
# (MIN_PARALLEL_NNZ kept weights), which runs them, the rope and the attention in one parallel region
WIDE = dict(hidden_size=256, intermediate_size=96)


def _inputs(how: str = "none", bias: bool = False, mask: bool = False, position: int = 5, seed: int = 0,
            wide: bool = False):
    """The op's arguments for layer 0 of a tiny Llama (q/k/v fused as fuse_siblings fuses them)."""
    model = tiny_model("qwen2" if bias else "llama", seed=seed, **(WIDE if wide else {}))
    dim = model.config.hidden_size // HEADS
    pattern = parse_pattern("1x16")
    packed = pack_targets(model, random_masks(model, pattern, seed=seed), pattern)
    packed = {name: quantize(layer, how) for name, layer in packed.items()}
    prefix = "model.layers.0.self_attn."
    q, k, v, o = (packed[prefix + name] for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    qkv = concat_outputs([_kernel_inputs(layer) for layer in (q, k, v)], model.config.hidden_size, 16)
    generator = torch.Generator().manual_seed(seed)
    width = model.config.hidden_size
    x = torch.randn(1, 1, width, generator=generator)
    angle = torch.rand(dim // 2, generator=generator) * 6
    cos, sin = torch.cat([angle.cos()] * 2).view(1, 1, 1, dim), torch.cat([angle.sin()] * 2).view(1, 1, 1, dim)
    keys, values = (torch.randn(1, KV_HEADS, MAX_LEN, dim, generator=generator) for _ in range(2))
    attend = torch.arange(position + 1).view(1, 1, 1, -1) % 3 != 1 if mask else None
    return [x, qkv.values, qkv.row_idx, qkv.row_ptr, qkv.bias, cos, sin, torch.tensor([position]), keys, values,
            position + 1, attend, dim ** -0.5, o.values, o.row_idx, o.row_ptr, o.bias, HEADS, width, 16, qkv.scales,
            o.scales]


def _kernel_inputs(layer) -> KernelInputs:
    return KernelInputs(layer.values, layer.row_idx, layer.row_ptr, layer.shape[0], layer.scales, layer.bias)


def _both(args):
    """(kernel output, kernel cache), (torch output, torch cache) from copies of one cache."""
    results = []
    for run in (attention_block, attention_block_torch):
        copied = list(args)
        copied[8], copied[9] = args[8].clone(), args[9].clone()
        results.append((run(*copied), copied[8], copied[9]))
    return results


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("how,bias,mask", [("none", False, False), ("none", True, True), ("int8", False, True),
                                           ("int4", False, False)])
def test_kernel_equals_the_torch_implementation(how, bias, mask, wide, two_threads):
    """Small layers run the three ops' own kernels in turn, wide ones one parallel region: both
    give the torch implementation's numbers exactly."""
    args = _inputs(how, bias, mask, wide=wide)
    (y, keys, values), (expected, expected_keys, expected_values) = _both(args)
    assert y.shape == (1, 1, args[18])
    assert torch.equal(y, expected)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    assert not torch.equal(keys, args[8])  # slot 5 written


def test_runs_are_identical(two_threads):
    args = _inputs("int4", wide=True)
    first, second = _both(args)[0], _both(args)[0]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_other_inputs_take_the_torch_implementation():
    """A strided cos is not the kernel's: the torch implementation runs it, with the same numbers."""
    args = _inputs()
    (expected, expected_keys, _), _ = _both(args)
    strided = torch.empty(1, 1, 1, 2 * args[5].shape[-1])[..., ::2]
    strided.copy_(args[5])
    args[5] = strided
    (y, keys, _), _ = _both(args)
    assert torch.equal(y, expected) and torch.equal(keys, expected_keys)


def test_a_slot_outside_the_cache_is_an_error():
    args = _inputs()
    args[7] = torch.tensor([MAX_LEN])
    with pytest.raises((IndexError, RuntimeError)):
        attention_block(*args)
