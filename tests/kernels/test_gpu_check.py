"""``bench/gpu_check.py`` runs end to end on CPU under the interpreter, before a GPU is at hand.

The script runs as a subprocess, as it is run on a GPU machine (tests never import bench scripts).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
# The tiny correctness grid: (group, values, d_out, d_in) x dtypes (int4: the half ones) x tokens.
TINY_LAYERS = {("1x256", "none", 96, 576), ("1x64", "none", 128, 320), ("32x32", "none", 100, 70),
               ("1x256", "none", 64, 512), ("1x64", "int4", 128, 320)}


def _run(env, *args):
    env = dict(env, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)


@pytest.mark.slow
def test_gpu_check_tiny_runs_under_the_interpreter(tmp_path):
    out = tmp_path / "gpu_check.json"
    # the correctness matrix at two token counts and two dtypes: test_triton_group_sparse.py covers the rest
    result = _run(dict(os.environ, TRITON_INTERPRET="1"), "--tiny", "--tokens", "1,33", "--dtypes",
                  "float32,bfloat16", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["interpreter"] is True
    rows = report["correctness"]
    assert all(row["passed"] for row in rows), [row for row in rows if not row["passed"]]
    cases = {(row["group"], row["how"], row["d_out"], row["d_in"], row["dtype"], row["tokens"]) for row in rows}
    assert cases == {(*layer[:2], *layer[2:], dtype, t) for layer in TINY_LAYERS for dtype in ("float32", "bfloat16")
                     for t in (1, 33) if layer[1] == "none" or dtype != "float32"}
    decode = report["decode"]  # the op and cuBLAS' stand-in on tiny shapes: the code path, each row's launch named
    assert {(row["group"], row["how"]) for row in decode} == {("1x256", "none"), ("1x64", "none"), ("1x256", "int8"),
                                                              ("1x256", "int4")}
    assert all(row["lowered_ms"] > 0 and row["timer"].startswith("interpreter") and row["config"] for row in decode)
    prefill = report["prefill"]  # 512 tokens: the op through the dense weight, and its tiled kernel beside it
    assert {row["group"] for row in prefill} == {"1x256", "32x32"}
    assert [row["config"] == "dense weight + cuBLAS" for row in prefill if row["group"] == "1x256"] == [True, False]
    e2e = report["e2e"]  # dense, lowered, int4 (two ways): the static decode step's greedy tokens equal the eager ones
    assert [row["weights"] for row in e2e] == ["dense", "lowered bf16", "lowered int4", "lowered int4, dot4"]
    assert all(row["passed"] and row["decode_ms"] > 0 for row in e2e)
    assert e2e[1]["greedy_equal"] == e2e[1]["greedy_tokens"] > 0
    assert 0 <= e2e[1]["logits_rel_error"] < 1e-4  # float32: the static step computes the eager step's logits
    sweep = report["sweep"]  # decode launches on the interpreter: each checked against the reference, then timed
    assert {(row["group"], row["how"], row["tokens"]) for row in sweep} == {
        ("1x256", "none", 1), ("1x256", "none", 5), ("1x64", "none", 1), ("1x256", "int8", 1), ("1x256", "int4", 1)}
    assert all(row["passed"] and row["best_ms"] <= row["default_ms"] for row in sweep)
    assert all(launch["error_vs_tolerance"] <= 1 for row in sweep for launch in row["all"])
    assert any(launch["block_t"] == 1 for row in sweep for launch in row["all"])  # the CUDA-core decode launch
    assert any(launch["dot4"] for row in sweep for launch in row["all"])  # int4 by integer dot products
    assert report["aoti"] == [{"section": "aoti", "variant": "skipped", "passed": True, "note": "needs a CUDA GPU"}]
    assert "checks: 28/28 passed" in result.stdout
    results = tmp_path / "gpu.json"
    records = subprocess.run([sys.executable, str(SCRIPT), "--records", str(out), "--suffix=-tiny", "--results",
                              str(results)], env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                             timeout=60)
    assert records.returncode == 0, records.stderr[-2000:]
    written = json.loads(results.read_text())
    assert [record["name"] for record in written] == [f"cuda-{section}-tiny" for section in
                                                      ("correctness", "decode", "prefill", "e2e", "sweep")]
    assert "logits_rel_error" in [column["key"] for column in written[3]["columns"]]


@pytest.mark.slow
def test_gpu_check_without_cuda_or_interpreter_exits_2():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = _run(dict(env, CUDA_VISIBLE_DEVICES=""), "--tiny")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip() == "needs a CUDA GPU or TRITON_INTERPRET=1"


@pytest.mark.slow
def test_gpu_check_runs_the_named_sections_only(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = _run(env, "--tiny", "--sections", "correctness", "--dtypes", "float32", "--tokens", "1,16",
                  "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["decode"] == report["prefill"] == report["e2e"] == report["learn"] == []
    assert {(row["dtype"], row["tokens"]) for row in report["correctness"]} == {("float32", 1), ("float32", 16)}
    assert all(row["passed"] for row in report["correctness"])
    bad = _run(env, "--tiny", "--sections", "correctness,speedy")
    assert bad.returncode == 2 and "bad --sections speedy" in bad.stderr


def test_segv_backtrace_prints_the_native_stack_and_dies_of_the_signal(tmp_path):
    """``bench/segv_backtrace.c``, preloaded, names the frames of a segmentation fault (how the aoti
    section finds where a package load crashes) and leaves the exit status a crash's."""
    library = tmp_path / "segv_backtrace.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(library), str(ROOT / "bench" / "segv_backtrace.c")],
                   check=True, timeout=60)
    crashed = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.string_at(0)"],
                             env=dict(os.environ, LD_PRELOAD=str(library)), capture_output=True, text=True, timeout=60)
    assert crashed.returncode == -11
    assert "native backtrace (segv_backtrace.c): signal SIGSEGV at address 0x0000000000000000" in crashed.stderr
    assert "_ctypes" in crashed.stderr  # the frame that made the bad read, by its library


def test_gpu_check_refuses_an_unknown_aoti_variant():
    result = _run(dict(os.environ, TRITON_INTERPRET="1"), "--sections", "aoti", "--aoti-variants", "dense,sparse")
    assert result.returncode == 2
    assert "bad --aoti-variants sparse: expected any of lowered, dense" in result.stderr
