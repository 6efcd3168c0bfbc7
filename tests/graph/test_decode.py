"""Exported decode over a static KV cache (``gmc.graph.decode``) and its lowering (``gmc.graph.pipeline.lower_decode``):
cached logits equal a no-cache forward, exported programs equal the eager step, the cache is written
where the position says, and the lowered programs hold one op per target with the eager lowered logits."""
import copy

import pytest
import torch
from conftest import random_masks, tiny_model

from gmc.errors import GmcError
from gmc.graph.decode import CachedLM, KVCache, export_decode, export_step
from gmc.graph.pipeline import LowerOptions, lower, lower_decode
from gmc.groups import parse_pattern
from gmc.kernels.linear import swap_group_sparse_linears
from gmc.kernels.packed import pack_dense
from gmc.kernels.quantize import quantize

OP = torch.ops.gmc.group_sparse_linear.default
MLP = torch.ops.gmc.group_sparse_gated_mlp.default
BLOCK = torch.ops.gmc.attention_block.default
LINEAR = torch.ops.aten.linear.default
MAX_LEN = 16


def _ops(program: torch.export.ExportedProgram, target) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target is target]


def _stepwise(step, config, ids: torch.Tensor, prompt: int) -> tuple[list[torch.Tensor], KVCache]:
    """Logits after ``ids[:, :prompt]`` (one call), then after each later token (one call each)."""
    cache = KVCache.empty(config, MAX_LEN)
    logits = [step(ids[:, :prompt], torch.tensor(0), cache.keys, cache.values)]
    for position in range(prompt, ids.shape[1]):
        logits.append(step(ids[:, position:position + 1], torch.tensor(position), cache.keys, cache.values))
    return logits, cache


@pytest.fixture(scope="module")
def lowered_llama():
    """``(model, packed, programs)``: a tiny Llama, its 1x16 packed targets and lowered programs."""
    model = tiny_model("llama")
    pattern = parse_pattern("1x16")
    _, packed = lower(model, random_masks(model, pattern, seed=1), pattern)
    return model, packed, lower_decode(model, packed, MAX_LEN)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cached_prompt_then_decode_equals_no_cache_forward(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    prompt = 5
    with torch.no_grad():
        cached, _ = _stepwise(CachedLM(model), model.config, ids, prompt)
        for end, logits in zip(range(prompt, ids.shape[1] + 1), cached):
            reference = model(ids[:, :end], use_cache=False).logits[:, -1]  # [1, V]
            assert logits.shape == reference.shape == (1, model.config.vocab_size)
            torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


def test_cache_is_written_up_to_the_position_only():
    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = _stepwise(CachedLM(model), model.config, ids, prompt=4)
    assert cache.max_len == MAX_LEN and len(cache.keys) == len(cache.values) == model.config.num_hidden_layers
    for tensor in (*cache.keys, *cache.values):  # [1, H_kv, M, D]
        assert tensor.shape == (1, 2, MAX_LEN, 16)
        written = tensor.abs().amax(dim=(0, 1, 3)) > 0  # [M]
        assert written[:7].all() and not written[7:].any()
    assert cache.nbytes == 2 * 2 * 2 * MAX_LEN * 16 * 4


def test_exported_programs_equal_the_eager_step():
    model = tiny_model("llama")
    programs = export_decode(model, MAX_LEN)
    assert set(programs) == {"prefill", "decode"}
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    eager = CachedLM(model)
    with torch.no_grad():
        expected, expected_cache = _stepwise(eager, model.config, ids, prompt=5)
        steps = {name: program.module() for name, program in programs.items()}
        cache = KVCache.empty(model.config, MAX_LEN)
        got = [steps["prefill"](ids[:, :5], torch.tensor(0), cache.keys, cache.values)]
        for position in range(5, 8):
            got.append(steps["decode"](ids[:, position:position + 1], torch.tensor(position), cache.keys, cache.values))
        prefill_other = KVCache.empty(model.config, MAX_LEN)  # the prefill program's token count is dynamic
        got_other = steps["prefill"](ids[:, :3], torch.tensor(0), prefill_other.keys, prefill_other.values)
        expected_other = model(ids[:, :3], use_cache=False).logits[:, -1]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for a, b in zip((*cache.keys, *cache.values), (*expected_cache.keys, *expected_cache.values)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_other, expected_other, atol=1e-5, rtol=0)


def test_attention_reads_only_the_filled_slots():
    """Slots past the sequence are never read (not merely masked): NaN there leaves the logits
    of the eager step and of both exported programs unchanged, so a step costs what the sequence
    holds rather than ``max_len``."""
    model = tiny_model("llama")
    programs = export_decode(model, MAX_LEN)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    steps = {"eager": (CachedLM(model), CachedLM(model)),
             "exported": (programs["prefill"].module(), programs["decode"].module())}
    with torch.no_grad():
        for name, (prefill, decode) in steps.items():
            results = []
            for poison in (0.0, float("nan")):
                cache = KVCache.empty(model.config, MAX_LEN)
                for tensor in (*cache.keys, *cache.values):
                    tensor[:, :, 5:] = poison  # beyond the prompt (5) and the decoded token (position 5)
                prefill(ids[:, :5], torch.tensor(0), cache.keys, cache.values)
                results.append(decode(ids[:, 5:6], torch.tensor(5), cache.keys, cache.values))
            assert torch.isfinite(results[1]).all(), name
            torch.testing.assert_close(results[1], results[0], atol=0, rtol=0)


def _trig(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op == "call_function"
            and n.target in (torch.ops.aten.cos.default, torch.ops.aten.sin.default)]


def _rope(kind: str | None) -> dict:
    return {} if kind is None else {"rope_parameters": {"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0}}


@pytest.mark.parametrize("arch,rope", [("llama", None), ("qwen3", None), ("llama", "linear")])
def test_programs_read_the_rotary_embedding_from_a_table(arch, rope):
    """cos and sin of every position the cache holds are computed once, by the model's own rotary
    module, and a step reads its rows: no sine or cosine left in either program (traced, Inductor
    fused them into every layer's consumer), and the programs give the eager step's logits exactly."""
    model = tiny_model(arch, **_rope(rope))
    programs = export_decode(model, MAX_LEN)
    for program in programs.values():
        assert _trig(program) == [] and program.constants["rope_cos"].shape == (MAX_LEN, model.config.head_dim)
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected, _ = _stepwise(CachedLM(model), model.config, ids, prompt=4)
        got, _ = _stepwise(_Programs(programs), model.config, ids, prompt=4)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert "forward" not in vars(model.model.rotary_emb)  # the model's own again


def test_a_rotary_embedding_that_depends_on_the_length_is_not_tabulated():
    """"dynamic" RoPE rescales its frequencies by the sequence's length: a table of every position
    at once would hold the long-sequence ones from the first token."""
    model = tiny_model("llama", **_rope("dynamic"))
    step = CachedLM(model, max_len=MAX_LEN)
    assert not hasattr(step, "rope_cos")
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got, _ = _stepwise(step, model.config, ids, prompt=3)
        expected, _ = _stepwise(CachedLM(model), model.config, ids, prompt=3)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


class _Programs:
    """Exported prefill and decode behind one step signature (prefill for more than one token)."""

    def __init__(self, programs):
        self.prefill, self.decode = programs["prefill"].module(), programs["decode"].module()

    def __call__(self, ids, position, keys, values):
        return (self.prefill if ids.shape[1] > 1 else self.decode)(ids, position, keys, values)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_attends_with_one_gmc_op_per_layer_and_prefill_with_sdpa(arch):
    """On CPU a one-token step's attention is ``gmc::decode_attention`` (C++: no batched GEMMs
    over the cache), one call per layer; prefill keeps SDPA."""
    model = tiny_model(arch)
    programs = export_decode(model, MAX_LEN)
    attention = torch.ops.gmc.decode_attention.default
    assert len(_ops(programs["decode"], attention)) == model.config.num_hidden_layers
    assert _ops(programs["prefill"], attention) == []
    assert not [n for n in programs["decode"].graph.nodes if n.op == "call_function"
                and n.target in (torch.ops.aten.matmul.default, torch.ops.aten.bmm.default)]


def test_lower_decode_fuses_the_targets_and_matches_the_eager_lowered_model(lowered_llama):
    model, packed, programs = lowered_llama
    assert set(programs) == {"prefill", "decode"}
    layers = model.config.num_hidden_layers
    assert len(packed) == 7 * layers
    for name, program in programs.items():
        ops = _ops(program, OP)
        # per layer q/k/v fused, o, and the MLP as one op (fuse=True), and the output head (head=True);
        # in decode q/k/v, the attention and o are one op more (fuse_attention)
        assert len(ops) == (2 * layers if name == "prefill" else 0) + 1
        assert len(_ops(program, BLOCK)) == (layers if name == "decode" else 0)
        assert len(_ops(program, MLP)) == layers
        assert not _ops(program, LINEAR)
        assert not any(name.endswith("_proj.weight") for name in program.state_dict)
        program.graph.lint()
    eager = swap_group_sparse_linears(copy.deepcopy(model), packed)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    steps = {name: program.module() for name, program in programs.items()}
    with torch.no_grad():
        expected, _ = _stepwise(CachedLM(eager), model.config, ids, prompt=6)
        cache = KVCache.empty(model.config, MAX_LEN)
        got = [steps["prefill"](ids[:, :6], torch.tensor(0), cache.keys, cache.values)]
        for position in range(6, 9):
            got.append(steps["decode"](ids[:, position:position + 1], torch.tensor(position), cache.keys, cache.values))
        dense = CachedLM(model)(ids[:, :6], torch.tensor(0), *_empty(model.config))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert (got[0] - dense).abs().max() > 1e-3  # the masks changed the model: not the dense program


def _empty(config) -> tuple[list, list]:
    cache = KVCache.empty(config, MAX_LEN)
    return cache.keys, cache.values


@pytest.mark.parametrize("head", [False, True])
def test_lower_decode_without_packed_layers_is_the_dense_program(head):
    """No packed layers: the dense program (with ``head``, its output head on the op, all kept)."""
    model = tiny_model("llama")
    programs = lower_decode(model, {}, MAX_LEN, LowerOptions(head=head))
    assert set(programs) == {"prefill", "decode"}
    for program in programs.values():
        assert len(_ops(program, OP)) == int(head)
        assert len(_ops(program, LINEAR)) == int(not head) + 7 * model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = programs["prefill"].module()(ids, torch.tensor(0), *_empty(model.config))
        torch.testing.assert_close(got, model(ids, use_cache=False).logits[:, -1], atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["none", "int8", "int4"])
def test_tied_embedding_reads_the_packed_head(how):
    """A tied head on the op: a float head is stored once (the embedding reads its packed values,
    transposed); a quantized head (int8, under int4 targets too) keeps the float embedding beside it.
    Logits equal the eager model's."""
    model = tiny_model("llama", tie_word_embeddings=True)
    pattern = parse_pattern("1x16")
    _, packed = lower(model, random_masks(model, pattern, seed=5), pattern, options=LowerOptions(quantize=how))
    programs = lower_decode(model, packed, MAX_LEN)
    head = model.lm_head.weight
    eager = swap_group_sparse_linears(copy.deepcopy(model), packed)
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(6))
    for program in programs.values():
        matrices = list({t.data_ptr(): t for t in program.state_dict.values() if t.numel() == head.numel()}.values())
        assert len(matrices) == 1 + (how != "none")  # a quantized head leaves the float embedding beside it
        assert any(t.dtype == (head.dtype if how == "none" else torch.int8) for t in matrices)
        targets = [t for name, t in program.state_dict.items() if "gmc_" in name and t.dtype == torch.uint8]
        assert bool(targets) == (how == "int4")
    with torch.no_grad():
        got = programs["prefill"].module()(ids, torch.tensor(0), *_empty(model.config))
        expected = CachedLM(eager)(ids, torch.tensor(0), *_empty(model.config))
        if how != "none":  # the head is quantized in the program only
            expected = CachedLM(swap_group_sparse_linears(
                copy.deepcopy(model), {**packed, "lm_head": quantize(pack_dense(head, "1x256"), "int8")}))(
                ids, torch.tensor(0), *_empty(model.config))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_bad_program_name_and_short_cache_are_refused():
    model = tiny_model("llama")
    with pytest.raises(GmcError, match="bad program 'verify'"):
        export_step(CachedLM(model), model.config, MAX_LEN, "verify")
    with pytest.raises(GmcError, match="bad max_len 1"):
        export_step(CachedLM(model), model.config, 1, "decode")
    with pytest.raises(GmcError, match="bad max_len 1"):
        export_decode(model, 1)
    with pytest.raises(GmcError, match="bad max_len 1"):
        lower_decode(model, {}, 1)


class _NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on what a CUDA graph cannot hold: a tensor's value read back to the host."""

    READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.READS:
            raise AssertionError(f"{func} reads a tensor's value on the host")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_step_reads_no_value_back_and_matches_the_filled_slots_step(arch):
    """``CachedLM(static=True)``: every slot under a mask made on the device from the position, so
    nothing is read back to the host (what a CUDA graph replays); the same logits as the step that
    reads only the filled slots, decode step by decode step."""
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, _ = _stepwise(CachedLM(model), model.config, ids, prompt=5)
        cache = KVCache.empty(model.config, MAX_LEN)
        static = CachedLM(model, static=True)
        got = [static(ids[:, :5], torch.tensor(0), cache.keys, cache.values)]
        for position in range(5, ids.shape[1]):
            with _NoHostReads():
                got.append(static(ids[:, position:position + 1], torch.tensor(position), cache.keys, cache.values))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_graphed_step_needs_cuda():
    from gmc.runtime.cuda_graph import GraphedStep

    model = tiny_model("llama")
    with pytest.raises(GmcError, match="needs the model and cache on a CUDA device"):
        GraphedStep(model, KVCache.empty(model.config, MAX_LEN))
