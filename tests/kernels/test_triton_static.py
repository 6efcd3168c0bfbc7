"""The CUDA kernel's machine code, read without a GPU (``python -m gmc.kernels.triton_static``).

Every launch the op would make on LLaMA-2-7B-shaped layers (``launch_matrix``: decode and prefill
block sizes; fp16, bf16, fp32 with IEEE and with TF32 products; float, int8 and int4 values; 1xG and
2-D group layouts; sm_90, and sm_80 for bf16) is compiled with the ptxas of the ``triton`` wheel,
and its SASS must show:

- no register spills (no local memory, no stack frame);
- the values read 16 bytes a load (``LDG.E.128``, or ``LDGSTS.E.BYPASS.128`` into shared memory),
  never in loads of one value's width (for halves, int8 and int4 codes);
- no atomics in an unsplit launch (every output element written once, by one program); a split
  decode launch stores its partial sums and takes one ordered ticket a program, nothing else;
- tensor-core products wherever the inputs are 16-bit or TF32 and a program takes 16 token rows or
  more; CUDA-core fused multiply-adds in a one-token decode launch;
- a prefill's dense-weight launches (``plan_dense``) store and load 16 bytes at a time.

Triton compiles a kernel only without ``TRITON_INTERPRET``, which the test session sets, so the
compiles run in one child process. One launch a program: ``test_inline_on_cuda.py``.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # about a second a compile, ~100 compiles


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("sass") / "launches.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "gmc.kernels.triton_static", "--json", str(out)], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_launch_compiles(compiled):
    assert len(compiled) >= 80
    assert {name.split()[0] for name in compiled} == {"1x256", "1x64", "32x32"}
    assert any("sm_80" in name for name in compiled) and any(" tf32 " in name for name in compiled)


def test_no_register_spills(compiled):
    spilled = {name: row["local_bytes"] for name, row in compiled.items() if row["local_bytes"]}
    assert not spilled


def test_values_load_16_bytes_at_a_time(compiled):
    """No load of one value's width in the loop."""
    assert all(row["wide_loads"] > 0 for row in compiled.values())
    narrow = {name: row["narrow_value_loads"] for name, row in compiled.items() if row["narrow_value_loads"]}
    assert not narrow


def test_no_ordered_atomics_but_one_a_split_program(compiled):
    """Unsplit launches have no atomics; a split one stores its partial sums with plain stores and takes
    one acq_rel ticket a program (one fence, one atomic): no atomics on the sums, none per element."""
    for name, row in compiled.items():
        assert row["reductions"] == 0, name
        if row["split"] == 1:
            assert row["ordered_atomics"] == row["fences"] == 0, name
        else:
            assert row["ordered_atomics"] == 1 and row["fences"] == 1, name
    assert any(row["split"] > 1 for row in compiled.values())


def test_products_run_on_tensor_cores(compiled):
    """16-bit and TF32 products of 16 token rows or more run on tensor cores; a one-token decode launch
    multiplies on CUDA cores (fused multiply-adds), with no 16-row tile of x."""
    products = {name: row for name, row in compiled.items() if not name.endswith("dense weight")}
    one_row = {name for name, row in products.items() if row["config"]["block_t"] < 16}
    assert one_row and all(name.endswith(("T=1 sm_90", "T=1 sm_80")) for name in one_row)
    assert all(products[name]["cuda_core_fmas"] and not products[name]["tensor_core_ops"] for name in one_row)
    cores = {name for name, row in products.items()
             if " fp32 " not in name and name not in one_row and not row["tensor_core_ops"]}
    assert not cores


def test_dense_weight_launches_write_16_bytes_at_a_time(compiled):
    """A prefill's dense-weight launch (``plan_dense``) stores the weight 16 bytes a store, reads the values
    16 bytes a load, multiplies nothing and takes no atomics: bf16 and fp32 weights of float, int8 and int4
    values, 1xG and 2-D layouts."""
    dense = {name: row for name, row in compiled.items() if name.endswith("dense weight")}
    assert len(dense) == 18 and {name.split()[2] for name in dense} == {"none", "int8", "int4"}
    for name, row in dense.items():
        assert row["stores"] == row["wide_stores"] > 0, name
        assert row["wide_loads"] > 0 and not row["narrow_value_loads"], name
        assert not row["tensor_core_ops"] and row["config"]["block_t"] == 0, name


def test_one_token_steps_issue_within_today_s_budget_a_weight(compiled):
    """What a one-token step issues a thread against the weights it reads (docs/gpu.md, "What a one-token
    step issues"): every step reads weights, converts each int4 or int8 weight at most once, and stays
    within a ceiling above today's counts (16-bit values 6.6-7.8 instructions a weight, int4 11.3-13.2),
    so a change that blows up the loop fails here before a GPU times it."""
    one = {name: row for name, row in compiled.items() if " T=1 " in name and not name.endswith("dense weight")}
    assert len(one) >= 30
    for name, row in one.items():
        weights = row["weights_a_thread_step"]
        assert weights > 0 and row["loop_instructions"] >= weights, name
        assert row["int_to_float"] <= weights, name
        if row["values"] in ("float16", "bfloat16"):
            assert row["loop_instructions"] <= 10 * weights and row["int_to_float"] == 0, name
        if row["values"] == "uint8" and " fp32 " not in name:  # int4 codes, 16-bit x
            assert row["loop_instructions"] <= 14 * weights, name


def test_one_token_int4_codes_through_the_mantissa_convert_nothing(compiled):
    """``KernelConfig.mantissa`` launches take no integer-to-float conversion, keep their loads 16 bytes wide
    and spill nothing (the shared checks above), and with 16-bit x issue fewer instructions a step than the
    converting launch of the same layer (docs/gpu.md: 721 -> 654 on a 1x256 layer)."""
    mantissa = {name: row for name, row in compiled.items() if " int4-mantissa " in name}
    assert len(mantissa) == 10 and all(row["config"]["mantissa"] for row in mantissa.values())
    for name, row in mantissa.items():
        converting = compiled[name.replace("int4-mantissa", "int4")]
        assert converting["int_to_float"] > 0 and row["int_to_float"] == 0, name
        assert row["wide_loads"] == converting["wide_loads"], name
        if " fp32 " not in name:
            assert row["loop_instructions"] < converting["loop_instructions"], name


def test_one_token_by_integer_dot_products_issue_a_fraction(compiled):
    """``KernelConfig.dot4`` launches (``dot4_config``) multiply every value in a ``dp4a`` (one for 4 int8 values,
    two for a word of 8 int4 codes), convert at most once per 16 values, keep their loads 16 bytes wide, spill nothing
    (the shared checks above), and issue at most 4.5 instructions a weight, fewer than the default launch of the
    same layer (and for int4 than the mantissa launch; docs/gpu.md: 2.5 against 11.3 and 10.2 on a 1x256 layer
    with bf16 x on sm_90)."""
    dot4 = {name: row for name, row in compiled.items() if "-dot4 " in name}
    assert len(dot4) == 8 and all(row["config"]["dot4"] and row["config"]["block_t"] == 1 for row in dot4.values())
    for name, row in dot4.items():
        weights = row["weights_a_thread_step"]
        assert row["dot_products"] == weights // 4 and row["int_to_float"] <= weights // 16, name
        assert row["wide_loads"] > 0 and row["narrow_value_loads"] == 0, name
        assert row["loop_instructions"] <= 4.5 * weights, name
        how = name.split()[2].removesuffix("-dot4")
        for other in (how, "int4-mantissa") if how == "int4" else (how,):
            base = compiled[name.replace(f"{how}-dot4", other)]
            assert row["loop_instructions"] / weights < base["loop_instructions"] / base["weights_a_thread_step"], name


_CACHED = """
import json, sys
from gmc.kernels import triton_static as ts
name, launch, arch = next(iter(ts.launch_matrix()))
first = ts.summarize(ts.compile_launch(launch, arch), launch)
kept = sorted(ts._sass_cache().glob("*.json.gz"))
kept[0].write_bytes(b"torn")  # a half-written or foreign file is read as missing
second = ts.summarize(ts.compile_launch(launch, arch), launch)
third = ts.summarize(ts.compile_launch(launch, arch), launch)
print(json.dumps({"files": len(kept), "same": first == second == third, "wide_loads": first["wide_loads"],
                  "rewritten": kept[0].read_bytes() != b"torn"}))
"""


def test_disassembly_is_kept_by_the_cubin_s_hash_and_a_torn_file_is_redone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _CACHED], env=dict(env, TRITON_CACHE_DIR=str(tmp_path)),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {"files": 1, "same": True, "wide_loads": found["wide_loads"], "rewritten": True}
    assert found["wide_loads"] > 0
