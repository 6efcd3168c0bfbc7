"""fuse_attention: a decode step's q/k/v op, rope, cache writes, attention and o op become one op;
logits and caches unchanged, bit for bit."""
import pytest
import torch
from conftest import random_masks, tiny_model

import gmc.graph.pipeline as pipeline
from gmc.graph.decode import KVCache
from gmc.graph.passes.fuse_attention import fuse_attention
from gmc.graph.pipeline import LowerOptions, lower, lower_decode
from gmc.groups import parse_pattern
from gmc.kernels.quantize import quantize

BLOCK = torch.ops.gmc.attention_block.default
ATTENTION = torch.ops.gmc.decode_attention.default


def _count(graph, target):
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target is target)


def _programs(arch: str, how: str = "none", fused: bool = True, monkeypatch=None, **options):
    model = tiny_model(arch)
    pattern = parse_pattern("1x16")
    _, packed = lower(model, random_masks(model, pattern, seed=1), pattern)
    packed = {name: quantize(layer, how) for name, layer in packed.items()}
    if not fused:
        monkeypatch.setattr(pipeline, "LOWER", tuple(p for p in pipeline.LOWER if p is not fuse_attention))
    return model, lower_decode(model, packed, 16, LowerOptions(**options))


def _run(model, programs, steps: int = 3):
    """Logits of a 5-token prefill and `steps` decode steps, and the cache after them."""
    cache = KVCache.empty(model.config, 16)
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = [programs["prefill"].module()(ids, torch.tensor(0), cache.keys, cache.values)]
        for i in range(steps):
            logits.append(programs["decode"].module()(torch.tensor([[7 + i]]), torch.tensor(5 + i), cache.keys,
                                                      cache.values))
    return torch.stack(logits), cache


@pytest.mark.parametrize("arch,how", [("llama", "none"), ("llama", "int4"), ("mistral", "int8"), ("qwen2", "none")])
@pytest.mark.slow
def test_each_decode_attention_becomes_one_op_with_the_same_logits_and_cache(arch, how, monkeypatch):
    """Llama, Mistral and Qwen2 (q/k/v biases): one op per layer in decode, none in prefill; the
    logits and both caches equal the unfused programs' exactly."""
    model, fused = _programs(arch, how)
    layers = model.config.num_hidden_layers
    decode = fused["decode"].graph
    assert _count(decode, BLOCK) == layers and _count(decode, ATTENTION) == 0
    assert _count(decode, torch.ops.aten.index_copy_.default) == 0
    assert _count(fused["prefill"].graph, BLOCK) == 0
    got, got_cache = _run(model, fused)
    _, unfused = _programs(arch, how, fused=False, monkeypatch=monkeypatch)
    assert _count(unfused["decode"].graph, BLOCK) == 0
    expected, cache = _run(model, unfused)
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(got_cache.keys + got_cache.values, cache.keys + cache.values))


@pytest.mark.slow
def test_layers_with_query_and_key_norms_and_unfused_programs_are_left_alone():
    """Qwen3 normalises q and k per head before the rope: no match; fuse=False runs no fusion."""
    model, programs = _programs("qwen3")
    assert _count(programs["decode"].graph, BLOCK) == 0
    assert _count(programs["decode"].graph, ATTENTION) == model.config.num_hidden_layers
    _, unfused = _programs("llama", fuse=False)
    assert _count(unfused["decode"].graph, BLOCK) == 0


@pytest.mark.slow
def test_a_second_run_finds_nothing_more():
    model, programs = _programs("llama")
    gm = fuse_attention(programs["decode"].module())
    assert _count(gm.graph, BLOCK) == model.config.num_hidden_layers
