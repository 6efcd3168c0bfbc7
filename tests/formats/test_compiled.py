"""AOTInductor-compiled prefill/decode packages (``gmc.formats.compiled``): they generate what the eager lowered
model generates, a process without gmc or transformers runs them from the directory alone, and
``load_compiled`` refuses directories it must not load. One compile (module fixture) serves every test."""
import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import random_masks, tiny_model
from safetensors import safe_open

from gmc.errors import GmcError
from gmc.formats.compiled import (
    COMPILED_DIR,
    CONSTANTS_FILE,
    INFO_FILE,
    RUNTIME_LIBRARY,
    CompiledStep,
    load_compiled,
)
from gmc.graph.decode import PROGRAMS, CachedLM, KVCache
from gmc.graph.pipeline import LowerOptions, lower, lower_decode, packed_head
from gmc.groups import parse_pattern
from gmc.kernels.linear import GroupSparseLinear, swap_group_sparse_linears
from gmc.lower.compile import _tied_once, compile_programs
from gmc.runtime.generate import SampleConfig, generate

MAX_LEN = 32

# A fresh process: torch + safetensors only, the directory's runtime library and decode package.
FRESH = r"""
import json, sys
import torch, torch._inductor
from safetensors.torch import load_file, save_file

directory, inputs, out = sys.argv[1:]
torch.ops.load_library(f"{directory}/libgmc_ops.so")
runner = torch._inductor.aoti_load_package(f"{directory}/decode.pt2")
consts = load_file(f"{directory}/constants.safetensors")
for alias, name in json.load(open(f"{directory}/compiled.json"))["aliases"].items():
    consts[alias] = consts[name]
runner.load_constants({k: consts[k] for k in runner.get_constant_fqns()}, check_full_update=True, user_managed=True)
x = load_file(inputs)
layers = len([k for k in x if k.startswith("key.")])
keys = [x[f"key.{i}"] for i in range(layers)]
values = [x[f"value.{i}"] for i in range(layers)]
logits = runner(x["ids"], x["position"], keys, values)
save_file({"logits": logits.contiguous(), **{f"key.{i}": k for i, k in enumerate(keys)}}, out)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("gmc", "transformers"))
print(json.dumps(loaded))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """``(directory, config, eager lowered model)``: a tiny Llama with tied embeddings (its head on the
    op, which the embedding reads), 1x16 masks, its lowered prefill/decode programs compiled once."""
    model = tiny_model("llama", tie_word_embeddings=True)
    pattern = parse_pattern("1x16")
    _, packed = lower(model, random_masks(model, pattern, seed=2), pattern)
    directory = tmp_path_factory.mktemp("compiled")
    compile_programs(lower_decode(model, packed, MAX_LEN), directory, MAX_LEN)
    return directory, model.config, swap_group_sparse_linears(copy.deepcopy(model), packed)


def test_tied_constants_are_stored_once_with_an_alias():
    """A dense tied head (``head=False``) shares the embedding's tensor: stored once, aliased."""
    table, other = torch.randn(8, 4), torch.randn(8, 4)
    stored, aliases = _tied_once({"embed.weight": table, "lm_head.weight": table, "other": other,
                                  "view": table[2:]})
    assert set(stored) == {"embed.weight", "other", "view"} and aliases == {"lm_head.weight": "embed.weight"}


def _prompt(config, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def _copy(directory, tmp_path):
    """A private copy of the compiled output to damage."""
    return shutil.copytree(directory, tmp_path / "copy")


@pytest.mark.slow
def test_compiled_directory_holds_packages_constants_runtime_and_info(compiled):
    directory = compiled[0]
    out = directory / COMPILED_DIR
    for name in ("prefill.pt2", "decode.pt2", CONSTANTS_FILE, RUNTIME_LIBRARY, INFO_FILE):
        assert (out / name).is_file(), name
    info = json.loads((out / INFO_FILE).read_text())
    assert info["max_len"] == MAX_LEN and info["dtype"] == "float32" and info["device"] == "cpu"
    cache = KVCache.empty(compiled[1], MAX_LEN)
    assert info["cache"] == {"layers": len(cache.keys), "shape": list(cache.keys[0].shape), "dtype": "float32"}
    assert info["torch"] == torch.__version__
    # the tied embedding reads the packed head (lower_decode's head): the matrix is stored once, no alias
    assert info["aliases"] == {}
    with safe_open(str(out / CONSTANTS_FILE), "pt") as constants:
        shapes = [constants.get_slice(name).get_shape() for name in constants.keys()]
    config = compiled[1]
    assert sum(math.prod(shape) == config.vocab_size * config.hidden_size for shape in shapes) == 1
    loaded = load_compiled(directory)
    assert loaded.max_len == MAX_LEN and loaded.dtype == torch.float32 and set(loaded.steps) == {"prefill", "decode"}


@pytest.mark.slow
def test_compiled_greedy_tokens_equal_the_eager_lowered_model(compiled):
    directory, config, eager = compiled
    ids = _prompt(config, 6)
    greedy = SampleConfig(max_new_tokens=20)
    step = CachedLM(eager)
    expected = generate({"prefill": step, "decode": step}, KVCache.empty(config, MAX_LEN), ids, greedy)
    got = generate(load_compiled(directory).steps, KVCache.empty(config, MAX_LEN), ids, greedy)
    assert got.tokens == expected.tokens and len(got.tokens) == 20
    one = generate(load_compiled(directory).steps, KVCache.empty(config, MAX_LEN), ids[:, :1], greedy)
    assert one.tokens == generate({"prefill": step, "decode": step}, KVCache.empty(config, MAX_LEN), ids[:, :1],
                                  greedy).tokens


@pytest.mark.slow
def test_a_compiled_step_is_the_packages_own_call_and_refuses_other_inputs(compiled):
    """gmc's step (specs read once, flat inputs to boxed_run) gives torch's runner's logits and
    cache writes, bit for bit; a package whose inputs are not (tokens, position, keys, values) is
    refused at load."""
    import types

    import torch._inductor
    import torch.utils._pytree as pytree

    directory, config, _ = compiled
    loaded = load_compiled(directory)
    runner = torch._inductor.aoti_load_package(str(directory / COMPILED_DIR / "decode.pt2"))
    runner.load_constants({key: loaded.constants[key] for key in runner.get_constant_fqns()},
                          check_full_update=True, user_managed=True)
    ids = _prompt(config, 5)
    caches = [KVCache.empty(config, MAX_LEN) for _ in range(2)]
    with torch.no_grad():
        got = [step(ids[:, :1], torch.tensor(3), cache.keys, cache.values)
               for step, cache in zip((loaded.steps["decode"], runner), caches)]
    assert torch.equal(got[0], got[1])
    assert all(torch.equal(a, b) for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values))
    spec = pytree.treespec_dumps(pytree.tree_flatten(((0, 0), {}))[1])
    other = types.SimpleNamespace(loader=types.SimpleNamespace(get_call_spec=lambda: [spec, spec]))
    with pytest.raises(GmcError, match="other inputs than"):
        CompiledStep(other, directory / "decode.pt2")


@pytest.mark.slow
def test_a_compiled_step_refuses_a_cache_it_was_not_compiled_for(compiled):
    """The package reads the cache at the strides it was compiled for: another length, dtype, layout
    or layer count is one line, never a write out of bounds; the right cache still runs."""
    directory, config, _ = compiled
    step = load_compiled(directory).steps["decode"]
    token, position = _prompt(config, 1), torch.tensor(3)
    right = KVCache.empty(config, MAX_LEN)
    longer = KVCache.empty(config, MAX_LEN + 8)
    bf16 = KVCache.empty(config, MAX_LEN, torch.bfloat16)
    strided = KVCache([k.transpose(1, 2).contiguous().transpose(1, 2) for k in right.keys], right.values)
    fewer = KVCache(right.keys[:-1], right.values[:-1])
    sliced = KVCache([k.narrow(2, 0, MAX_LEN - 4) for k in right.keys], right.values)
    for cache, says in ((longer, rf"x \[1, \d+, {MAX_LEN + 8}, \d+\] float32"), (bf16, "bfloat16"),
                        (strided, "keys .* not contiguous"), (fewer, rf"keys {len(right.keys) - 1} x"),
                        (sliced, rf"keys .*{MAX_LEN - 4}")):
        with pytest.raises(GmcError, match=rf"decode.pt2 reads a KV cache of {len(right.keys)} x .* float32, "
                                           rf"contiguous, on the CPU; got .*{says}.*"
                                           rf"KVCache.empty\(config, {MAX_LEN}, torch.float32\)$"):
            step(token, position, cache.keys, cache.values)
    with torch.no_grad():
        assert step(token, position, right.keys, right.values).shape == (1, config.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [2, 7, 30])
def test_compiled_logits_match_the_eager_lowered_model(compiled, prompt):
    directory, config, eager = compiled
    steps = load_compiled(directory).steps
    ids = _prompt(config, prompt + 1, seed=prompt)
    eager_cache, cache = KVCache.empty(config, MAX_LEN), KVCache.empty(config, MAX_LEN)
    with torch.no_grad():
        for program, (tokens, position) in (("prefill", (ids[:, :prompt], 0)), ("decode", (ids[:, prompt:], prompt))):
            expected = CachedLM(eager)(tokens, torch.tensor(position), eager_cache.keys, eager_cache.values)
            got = steps[program](tokens, torch.tensor(position), cache.keys, cache.values)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    for a, b in zip((*cache.keys, *cache.values), (*eager_cache.keys, *eager_cache.values)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)  # the packages write the caches in place


@pytest.mark.slow
def test_compiled_int4_package_matches_the_eager_int4_model(tmp_path):
    """int4 targets (and the int8 head LowerOptions gives them) compiled: prefill and decode logits
    equal the eager model's on the same packed layers."""
    model = tiny_model("llama", tie_word_embeddings=True)
    pattern, options = parse_pattern("1x32"), LowerOptions(quantize="int4")
    _, packed = lower(model, random_masks(model, pattern, seed=3), pattern, options=options)
    assert all(layer.quantized == "int4" for layer in packed.values())
    compile_programs(lower_decode(model, packed, MAX_LEN, options), tmp_path, MAX_LEN)
    eager = swap_group_sparse_linears(copy.deepcopy(model), {**packed, **packed_head(model, packed, options)})
    steps = load_compiled(tmp_path).steps
    ids = _prompt(model.config, 8, seed=4)
    eager_cache, cache = KVCache.empty(model.config, MAX_LEN), KVCache.empty(model.config, MAX_LEN)
    with torch.no_grad():
        for program, (tokens, position) in (("prefill", (ids[:, :7], 0)), ("decode", (ids[:, 7:], 7))):
            expected = CachedLM(eager)(tokens, torch.tensor(position), eager_cache.keys, eager_cache.values)
            got = steps[program](tokens, torch.tensor(position), cache.keys, cache.values)
            # both quantize x to int8 per 32 numbers (the int8 head's too): a last-bit difference of the
            # compiled norms can move one code by a step, far below what a float product in place of
            # int4 would move
            torch.testing.assert_close(got, expected, atol=3e-3 * expected.abs().max().item(), rtol=0)


@pytest.mark.slow
def test_a_process_without_gmc_runs_the_compiled_decode_step(compiled, tmp_path):
    from safetensors.torch import load_file, save_file

    directory, config, _ = compiled
    steps = load_compiled(directory).steps
    cache = KVCache.empty(config, MAX_LEN)
    ids = _prompt(config, 5, seed=9)
    token = steps["prefill"](ids, torch.tensor(0), cache.keys, cache.values).argmax(-1, keepdim=True)  # [1, 1]
    inputs = {"ids": token, "position": torch.tensor(5),
              **{f"key.{i}": k.clone() for i, k in enumerate(cache.keys)},
              **{f"value.{i}": v.clone() for i, v in enumerate(cache.values)}}
    save_file(inputs, tmp_path / "inputs.safetensors")
    expected = steps["decode"](token, torch.tensor(5), cache.keys, cache.values)

    env = {**os.environ, "PYTHONPATH": ""}  # nothing puts gmc within reach but the test's own path
    done = subprocess.run([sys.executable, "-c", FRESH, str(directory / COMPILED_DIR),
                           str(tmp_path / "inputs.safetensors"), str(tmp_path / "out.safetensors")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []  # no gmc, no transformers module
    out = load_file(tmp_path / "out.safetensors")
    # the same generated code and kernel source: equal up to the kernel's summation order
    torch.testing.assert_close(out["logits"], expected, atol=1e-6, rtol=0)
    for i, keys in enumerate(cache.keys):  # position 5 written alike, nothing else touched
        torch.testing.assert_close(out[f"key.{i}"], keys, atol=1e-6, rtol=0)
        assert torch.equal(out[f"key.{i}"][:, :, :5], inputs[f"key.{i}"][:, :, :5])
        assert out[f"key.{i}"][:, :, 5].abs().max() > 0 and not out[f"key.{i}"][:, :, 6:].any()


@pytest.mark.slow
def test_load_compiled_alone_defines_the_op_its_packages_call(compiled):
    """A process that imports only ``gmc.formats.compiled`` (not the pipeline, which defines the op) loads and runs."""
    directory, config, _ = compiled
    script = ("import sys, torch\n"
              "from gmc.formats.compiled import load_compiled\n"
              "steps = load_compiled(sys.argv[1]).steps\n"
              "keys = [torch.zeros(1, 2, 32, 16) for _ in range(2)]\n"
              "values = [torch.zeros(1, 2, 32, 16) for _ in range(2)]\n"
              "print(int(steps['decode'](torch.tensor([[5]]), torch.tensor(0), keys, values).argmax()))\n")
    done = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    cache = KVCache.empty(config, MAX_LEN)
    expected = load_compiled(directory).steps["decode"](torch.tensor([[5]]), torch.tensor(0), cache.keys, cache.values)
    assert int(done.stdout.strip().splitlines()[-1]) == int(expected.argmax())


@pytest.mark.slow
def test_the_cpu_package_calls_the_op_through_its_c_shim(compiled):
    """No dispatcher call of gmc's ops inside a compiled step (the proxy executor's path records
    one): the package calls ``aoti_torch_cpu_group_sparse_linear`` and
    ``aoti_torch_cpu_decode_attention`` in the kernel library directly."""
    from torch.profiler import ProfilerActivity, profile

    directory, config, eager = compiled
    steps, cache = load_compiled(directory).steps, KVCache.empty(config, MAX_LEN)
    lowered = next(module for module in eager.modules() if isinstance(module, GroupSparseLinear))
    x = torch.randn(1, lowered.in_features)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        steps["decode"](torch.tensor([[5]]), torch.tensor(0), cache.keys, cache.values)
        lowered(x)  # one dispatcher call of the op outside the package: the profiler does record them
    calls = [event.name for event in prof.events() if event.name.startswith("gmc::")]
    assert calls == ["gmc::group_sparse_linear"]


@pytest.mark.slow
def test_the_packages_read_every_row_ptr_as_a_constant(compiled):
    """Inductor inlines constants of up to 8 numbers: a packed layer's row_ptr (one number per input
    block and one) was rebuilt by a generated kernel into a fresh buffer before every op call, ~3 us
    a call (``always_keep_tensor_constants``: docs/lowering.md)."""
    import torch._inductor

    directory, _, eager = compiled
    layers = sum(isinstance(module, GroupSparseLinear) for module in eager.modules())
    for name in PROGRAMS:
        runner = torch._inductor.aoti_load_package(str(directory / COMPILED_DIR / f"{name}.pt2"))
        row_ptrs = [fqn for fqn in runner.get_constant_fqns() if fqn.endswith("row_ptr")]
        assert 0 < len(row_ptrs) <= layers + 1  # fused siblings share one; the head adds one


@pytest.mark.slow
def test_load_compiled_refuses_without_the_cpu_kernel(compiled, monkeypatch):
    """A CPU package links to the kernel library: without it (no compiler, GMC_CPU_KERNEL=torch) one line."""
    import gmc.formats.compiled

    monkeypatch.setattr(gmc.formats.compiled, "kernel", lambda: None)
    with pytest.raises(GmcError, match="calls gmc's C\\+\\+ CPU kernel, which this process cannot load"):
        load_compiled(compiled[0])


@pytest.mark.slow
def test_load_compiled_refuses_a_group_writable_directory(compiled, tmp_path):
    copy_dir = _copy(compiled[0], tmp_path)
    out = copy_dir / COMPILED_DIR
    out.chmod(out.stat().st_mode | 0o020)
    with pytest.raises(GmcError, match="refusing to load compiled code from .*writable by nobody else"):
        load_compiled(copy_dir)
    out.chmod(out.stat().st_mode & ~0o020)
    package = out / "decode.pt2"
    package.chmod(package.stat().st_mode | 0o002)
    with pytest.raises(GmcError, match="decode.pt2"):
        load_compiled(copy_dir)


@pytest.mark.slow
def test_load_compiled_refuses_another_torch_version(compiled, tmp_path):
    copy_dir = _copy(compiled[0], tmp_path)
    info_path = copy_dir / COMPILED_DIR / INFO_FILE
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "torch": "2.0.0"}))
    with pytest.raises(GmcError, match=re.escape(f"compiled with torch 2.0.0, this is {torch.__version__}")):
        load_compiled(copy_dir)


@pytest.mark.slow
def test_load_compiled_refuses_an_older_packed_format(compiled, tmp_path):
    """A package compiled before int8 values went into words of 4 holds them row-major."""
    copy_dir = _copy(compiled[0], tmp_path)
    info_path = copy_dir / COMPILED_DIR / INFO_FILE
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({key: value for key, value in info.items() if key != "packed_format"}))
    with pytest.raises(GmcError, match="packed layers of format v2, this gmc runs v3: compile again"):
        load_compiled(copy_dir)


@pytest.mark.slow
def test_load_compiled_refuses_a_missing_constant(compiled, tmp_path):
    from safetensors.torch import load_file, save_file

    copy_dir = _copy(compiled[0], tmp_path)
    path = copy_dir / COMPILED_DIR / CONSTANTS_FILE
    constants = load_file(path)
    dropped = min(name for name in constants if name.endswith("q_proj.weight") or "gmc_packed" in name)
    save_file({k: v for k, v in constants.items() if k != dropped}, path)
    with pytest.raises(GmcError, match=re.escape(f"lacks '{dropped}'")):
        load_compiled(copy_dir)


def test_load_compiled_refuses_a_directory_without_programs(tmp_path):
    with pytest.raises(GmcError, match="no compiled programs"):
        load_compiled(tmp_path)


def test_load_compiled_refuses_cuda_packages(tmp_path):
    """AOTInductor's loader crashed on CUDA packages of the decode programs (dense ones too): gmc says so
    in one line instead of loading one (``gmc lower --compile --backend triton`` makes none)."""
    out = tmp_path / COMPILED_DIR
    out.mkdir()
    (out / INFO_FILE).write_text(json.dumps({"max_len": 8, "dtype": "bfloat16", "device": "cuda",
                                             "torch": torch.__version__}))
    with pytest.raises(GmcError, match="CUDA packages, which gmc does not load.*CUDA graph"):
        load_compiled(tmp_path)
