"""A finished training run is never lost and a checkpoint never runs code:
faults between training and the artifact write keep the checkpoint, ``--resume`` re-exports the
same masks without training again; crafted pickles are refused unrun; two SIGTERMs exit 143."""
import errno
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import (
    LEARN_CLI_STEPS,
    CharTokenizer,
    learn_cli_args,
    run_log,
    tiny_model,
    wait_for_checkpoint,
)

from gmc.errors import GmcError
from gmc.inputs.model import LoadedModel
from gmc.masks.learn import LearnConfig
from gmc.masks.prune import PruneConfig, prune

STEPS = 12


def _run(out, **learn):
    model = tiny_model("llama", hidden_size=128, intermediate_size=320)
    config = PruneConfig(model="tiny", output=str(out), method="groupmask", group="1x64", sparsity=0.5,
                         calib="bundled", nsamples=8, seq_len=32, seed=0,
                         learn=LearnConfig(steps=STEPS, lr=5e-3, checkpoint_every=5, progress=False, **learn))
    return prune(config, LoadedModel(model, CharTokenizer(), "tiny"))


def _same_run(a, b) -> None:
    assert a.masks.keys() == b.masks.keys() and all(torch.equal(a.masks[n], b.masks[n]) for n in a.masks)


@pytest.mark.slow
def test_disk_full_at_the_artifact_write_keeps_the_checkpoint_and_resume_finishes(tmp_path, monkeypatch):
    import gmc.formats.artifact
    import gmc.masks.training

    reference = _run(tmp_path / "ref")
    assert not (tmp_path / "ref.ckpt").exists()  # removed once the artifact was in place

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(gmc.formats.artifact, "save_file", disk_full)
        with pytest.raises(OSError):
            _run(tmp_path / "run")
    state = torch.load(tmp_path / "run.ckpt" / "state.pt", weights_only=True)
    assert state["step"] == STEPS  # the final step was checkpointed before the write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref", "run.ckpt"]  # no artifact, no temporaries

    def no_training(*args, **kwargs):
        raise AssertionError("a resumed finished run must not train again")

    monkeypatch.setattr(gmc.masks.training, "_train_step", no_training)
    resumed = _run(tmp_path / "run", resume=True)
    _same_run(reference, resumed)
    assert run_log(tmp_path / "ref") == run_log(tmp_path / "run")
    assert not (tmp_path / "run.ckpt").exists()


def _prune_cmd(model_dir, out, *extra, steps=LEARN_CLI_STEPS):
    """The kill-and-resume tests' command (``learned_run`` is its run through, with ``steps`` unchanged)."""
    return learn_cli_args(model_dir, out, *extra, steps=steps)


# gmc's CLI with SIGTERM arriving just before the artifact is written (after training)
_TERMINATED_BEFORE_WRITE = """
import os, signal, sys
import gmc.masks.prune
real = gmc.masks.prune.save_artifact
def terminated(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
gmc.masks.prune.save_artifact = terminated
from gmc.cli.main import main
sys.argv = ["gmc", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_sigterm_between_training_and_the_artifact_keeps_the_checkpoint(tiny_model_dir, learned_run, tmp_path):
    """``learned_run``: the same command run through (one thread, as here), the reference."""
    from gmc.formats.artifact import load_artifact

    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(*args):
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)

    killed = run("-c", _TERMINATED_BEFORE_WRITE, *_prune_cmd(tiny_model_dir, tmp_path / "run"))
    assert killed.returncode == 143, killed.stderr
    assert not (tmp_path / "run").exists()
    assert torch.load(tmp_path / "run.ckpt" / "state.pt", weights_only=True)["step"] == LEARN_CLI_STEPS
    resumed = run("-m", "gmc", *_prune_cmd(tiny_model_dir, tmp_path / "run", "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    _same_run(load_artifact(learned_run), load_artifact(tmp_path / "run"))
    assert not (tmp_path / "run.ckpt").exists()


@pytest.mark.slow
def test_two_sigterms_exit_143(tiny_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # long enough to be running when the signals land; eager, as --compile-step auto would compile 400 steps
    command = _prune_cmd(tiny_model_dir, tmp_path / "run", "--compile-step", "off", steps=400)
    proc = subprocess.Popen([sys.executable, "-m", "gmc", *command], env=env, stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(tmp_path / "run.ckpt" / "state.pt", proc, 4)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, stderr


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: the file appears iff the pickle ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_crafted_checkpoint_is_refused_without_running_it(tmp_path):
    probe = tmp_path / "probe-ran"
    torch.save(_Payload(probe), tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False).close()  # the payload is real: an unsafe load runs it
    assert probe.exists()

    marker = tmp_path / "payload-ran"
    (tmp_path / "out.ckpt").mkdir()
    torch.save({"identity": {}, "step": 1, "module": _Payload(marker)}, tmp_path / "out.ckpt" / "state.pt")
    with pytest.raises(GmcError, match="unsafe checkpoint .* was not loaded"):
        _run(tmp_path / "out", resume=True)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_crafted_self_calibration_cache_is_ignored_without_running_it(tmp_path, monkeypatch):
    from gmc.formats.artifact import model_fingerprint
    from gmc.inputs.calib import self_generated_blocks

    monkeypatch.setenv("GMC_CACHE", str(tmp_path / "cache"))
    loaded = LoadedModel(tiny_model("llama"), CharTokenizer(), "tiny")
    marker = tmp_path / "payload-ran"
    (tmp_path / "cache" / "self").mkdir(parents=True)
    torch.save(_Payload(marker), tmp_path / "cache" / "self" / f"{model_fingerprint(loaded.model)}-1x4-seed0.pt")
    with pytest.warns(RuntimeWarning, match="ignoring the unreadable self-calibration cache"):
        blocks = self_generated_blocks(loaded, 1, 4, 0)
    assert tuple(blocks.shape) == (1, 4) and not marker.exists()


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_lambda_must_be_positive_and_finite(value):
    with pytest.raises(GmcError, match="must be positive and finite"):
        LearnConfig(lam=value)
