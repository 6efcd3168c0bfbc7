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
# The tiny correctness grid: (group, d_out, d_in) x dtypes x tokens.
TINY_LAYERS = {("1x256", 96, 576), ("1x64", 128, 320), ("32x32", 100, 70), ("1x256", 64, 512)}
DTYPES = {"float32", "float16", "bfloat16"}


def _run(env, *args):
    env = dict(env, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.slow
def test_gpu_check_tiny_runs_under_the_interpreter(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = _run(dict(os.environ, TRITON_INTERPRET="1"), "--tiny", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["interpreter"] is True
    rows = report["correctness"]
    assert all(row["passed"] for row in rows), [row for row in rows if not row["passed"]]
    cases = {(row["group"], row["d_out"], row["d_in"], row["dtype"], row["tokens"]) for row in rows}
    assert cases == {(*layer, dtype, t) for layer in TINY_LAYERS for dtype in DTYPES for t in (1, 5, 33)}
    assert len(rows) == len(cases)
    speed = report["speed"]
    assert {(row["dtype"], row["tokens"]) for row in speed} == {(d, t) for d in ("float16", "bfloat16") for t in (1, 33)}
    assert all(row["lowered_ms"] > 0 and row["dense_ms"] > 0 and row["timer"].startswith("interpreter") for row in speed)
    [decode] = report["decode"]  # dense vs lowered through lower_decode, exported (not compiled) under --tiny
    assert decode["passed"] and decode["prefill_rel_error"] <= 1e-4
    assert decode["dense_ms"] > 0 and decode["lowered_ms"] > 0
    assert decode["gmc_op_calls"] > 0  # uncompiled programs call the op; a compiled CUDA step must not
    [learn] = report["learn"]  # a few eager mask-learning steps of a tiny Llama: the code path
    assert learn["passed"] and learn["steps"] == 6 and learn["step_ms"] > 0 and abs(learn["sparsity"] - 0.5) <= 0.01
    assert "correctness, decode and learning checks: 38/38 passed" in result.stdout


def test_gpu_check_without_cuda_or_interpreter_exits_2():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = _run(dict(env, CUDA_VISIBLE_DEVICES=""), "--tiny")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip() == "needs a CUDA GPU or TRITON_INTERPRET=1"


def test_gpu_check_runs_the_named_sections_only(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = _run(env, "--tiny", "--sections", "correctness", "--dtypes", "float32", "--tokens", "1,16",
                  "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["speed"] == [] and report["decode"] == [] and report["learn"] == []
    assert {(row["dtype"], row["tokens"]) for row in report["correctness"]} == {("float32", 1), ("float32", 16)}
    assert all(row["passed"] for row in report["correctness"])
    bad = _run(env, "--tiny", "--sections", "correctness,speedy")
    assert bad.returncode == 2 and "bad --sections speedy" in bad.stderr
