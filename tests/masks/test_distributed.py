"""Distributed mask learning on CPU: torchrun + gloo + FSDP2 on a tiny Llama.

Every launch is a real ``torchrun --nproc-per-node 2 -m gmc prune`` subprocess; the 2-rank
reference run is shared by the equivalence and the kill-and-resume tests. The one-process run the
equivalence test compares with runs in process, on one thread as the ranks do.
"""
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import invoke_gmc, run_log, wait_for_checkpoint

from gmc.formats.artifact import load_artifact

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _args(model_dir, out, *extra):
    return ["prune", str(model_dir), "--group", "1x64", "--calib", "bundled", "--seq-len", "32", "--nsamples", "8",
            "--steps", "20", "--lr", "5e-3", "--batch-size", "2", "--checkpoint-every", "4", "--quiet",
            "-o", str(out), *extra]


def _torchrun(*args):
    return [*TORCHRUN, "-m", "gmc", *args]


def _agreement(a, b) -> float:
    same = sum(int((a.masks[n] == b.masks[n]).sum()) for n in a.masks)
    return same / sum(m.numel() for m in a.masks.values())


@pytest.fixture(scope="module")
def two_rank_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "two"
    result = subprocess.run(_torchrun(*_args(tiny_model_dir, out)), env=ENV, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("wrote ") == 1  # rank 0 alone reports
    return out


@pytest.mark.slow
def test_two_ranks_learn_the_selectors_of_one_process(tiny_model_dir, two_rank_run, tmp_path):
    single = tmp_path / "single"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' OMP_NUM_THREADS=1
    try:
        result = invoke_gmc(*_args(tiny_model_dir, single))
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    a, b = load_artifact(single), load_artifact(two_rank_run)
    assert list(a.masks) == list(b.masks)  # same targets, same (execution) order
    assert _agreement(a, b) >= 0.995
    assert b.manifest["training"]["world_size"] == 2
    log_a, log_b = run_log(single), run_log(two_rank_run)
    assert [r["step"] for r in log_b] == list(range(1, 21))
    # the global batch and the global KD normalisation: same losses up to reduction order
    for x, y in zip(log_a, log_b):
        assert x["kd"] == pytest.approx(y["kd"], rel=1e-4) and x["sparsity"] == pytest.approx(y["sparsity"], abs=0.02)
    assert not (two_rank_run.parent / "two.ckpt").exists()


@pytest.mark.slow
def test_killed_launcher_then_resume_matches_uninterrupted_run(tiny_model_dir, two_rank_run, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_torchrun(*_args(tiny_model_dir, out)), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(tmp_path / "run.ckpt" / "state.pt", proc, 8)
    proc.send_signal(signal.SIGTERM)  # what a scheduler does on preemption; torchrun stops its workers
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and not out.exists()
    resumed = subprocess.run(_torchrun(*_args(tiny_model_dir, out, "--resume")), env=ENV,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = load_artifact(two_rank_run), load_artifact(out)
    assert all(torch.equal(a.masks[n], b.masks[n]) for n in a.masks)
    assert run_log(two_rank_run) == run_log(out)  # bit for bit: same world size, same reduction order


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("gmc: error:")]
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_world_size_not_dividing_the_batch_is_one_clear_error(tiny_model_dir, tmp_path):
    result = subprocess.run(_torchrun(*_args(tiny_model_dir, tmp_path / "o", "--batch-size", "3")), env=ENV,
                            capture_output=True, text=True)
    assert "world size 2 does not divide --batch-size 3" in _one_error_line(result)


@pytest.mark.slow
def test_a_model_the_ranks_cannot_see_is_one_clear_error(tmp_path):
    result = subprocess.run(_torchrun(*_args(tmp_path / "missing", tmp_path / "o")), env=ENV,
                            capture_output=True, text=True)
    assert "loading" in _one_error_line(result) and "failed on every rank" in result.stderr


def _one_rank_fails(rank, port, results):
    import torch.distributed as dist

    from gmc.errors import GmcError
    from gmc.masks.distributed import Dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def load():
        if rank == 1:
            raise GmcError("no such directory /data/model")
        return "model"

    try:
        Dist(rank, 2, torch.device("cpu")).on_all(load, "loading /data/model")
        results[rank] = "ok"
    except GmcError as error:
        results[rank] = str(error)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_rank_failing_to_load_fails_every_rank_with_its_message():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_one_rank_fails, args=(port, results), nprocs=2)
    expected = "loading /data/model failed on rank 1 of 2: no such directory /data/model"
    assert dict(results) == {0: expected, 1: expected}
