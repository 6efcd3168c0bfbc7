"""Weight recovery on tiny models: zeros stay zero, the KD loss falls, resume is bit-exact."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import CharTokenizer, invoke_gmc, tiny_model, wait_for_checkpoint

from gmc.formats.artifact import load_artifact
from gmc.groups import GroupSpec
from gmc.inputs.calib import load_texts, token_blocks
from gmc.masks.distill import soft_cross_entropy
from gmc.masks.heuristics import heuristic_masks
from gmc.masks.recover import RecoverConfig, recover_weights
from gmc.masks.sources.magnitude import magnitude_scores


def _kd(model, teacher, blocks) -> float:
    """KL(teacher || model) on ``blocks``: the distillation loss less the teacher's own entropy."""
    with torch.no_grad():
        target = teacher(blocks).logits
        return float(soft_cross_entropy(model(blocks).logits, target) - soft_cross_entropy(target, target))


def test_recovery_keeps_pruned_weights_zero_and_lowers_the_calibration_kd(tmp_path):
    dense = tiny_model("llama", hidden_size=128, intermediate_size=320)
    model = tiny_model("llama", hidden_size=128, intermediate_size=320)
    pattern = GroupSpec(1, 64)
    names = [n for n, m in model.named_modules() if n.endswith(("_proj",))]
    weights = {n: model.get_submodule(n).weight for n in names}
    masks = heuristic_masks(magnitude_scores(weights), pattern, 0.5, "uniform")
    blocks = token_blocks(CharTokenizer(), load_texts("bundled", "train")[0], 32, 8, 0)
    masked = tiny_model("llama", hidden_size=128, intermediate_size=320)
    for n in names:
        masked.get_submodule(n).weight.data.mul_(pattern.expand(masks[n], tuple(weights[n].shape)))
    before = _kd(masked, dense, blocks)
    frozen = {n: p.clone() for n, p in model.named_parameters() if not n.endswith("_proj.weight")}

    result = recover_weights(model, masks, pattern, blocks, RecoverConfig(steps=40, lr=1e-3, progress=False),
                             tmp_path / "ckpt", identity={}, seed=0)
    after = _kd(model, dense, blocks)
    assert after < 0.7 * before, (before, after)
    for n in names:
        keep = pattern.expand(masks[n], tuple(weights[n].shape))
        assert torch.equal(result.weights[n][~keep], torch.zeros_like(result.weights[n][~keep]))  # exactly 0
        assert not torch.equal(result.weights[n], masked.get_submodule(n).weight)  # kept ones moved
    assert all(torch.equal(frozen[n], p) for n, p in model.named_parameters() if n in frozen)
    assert not any(p.requires_grad for p in model.parameters())
    log = [json.loads(line) for line in result.log.decode().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 41))


def test_recovery_on_a_learned_graph_takes_the_eager_steps(tmp_path):
    """The graph path (``--recover-steps`` after a learned run: selectors holding the masks, a delta per
    target, the run's cached teacher) takes the eager path's steps: same start weights, same blocks, same
    AdamW updates, fp32, to float rounding; the model itself stays dense."""
    from gmc.graph.pipeline import prepare
    from gmc.graph.targets import TargetFilter
    from gmc.masks.recover import LearnedGraph
    from gmc.masks.student import Student
    from gmc.masks.teacher import Teacher

    pattern = GroupSpec(1, 64)
    eager = tiny_model("llama", hidden_size=128, intermediate_size=320)
    learned = tiny_model("llama", hidden_size=128, intermediate_size=320)
    gm, targets, selectors = prepare(learned, pattern, TargetFilter())
    names = [t.name for t in targets]
    dense = {n: learned.get_submodule(n).weight.detach().clone() for n in names}
    masks = heuristic_masks(magnitude_scores(dense), pattern, 0.5, "uniform")
    torch.manual_seed(0)  # start weights of their own, as a learned run's (W + delta) * M
    start = {n: (w + 0.01 * torch.randn_like(w)) * pattern.expand(masks[n], tuple(w.shape)) for n, w in dense.items()}
    blocks = token_blocks(CharTokenizer(), load_texts("bundled", "train")[0], 32, 4, 0)
    config = RecoverConfig(steps=6, lr=1e-3, weight_decay=1.0, progress=False)
    reference = recover_weights(eager, masks, pattern, blocks, config, tmp_path / "eager", identity={}, seed=0,
                                weights=start)
    graph = LearnedGraph(selectors, {t.name: gm.get_parameter(t.node.args[1].target) for t in targets},
                         Student(gm, compiled=False), Teacher(gm, blocks, "cpu", cache=True, precision="fp32"),
                         "fp32", compiled=False)
    result = recover_weights(learned, masks, pattern, blocks, config, tmp_path / "graph", identity={}, seed=0,
                             weights=start, graph=graph)
    assert result.manifest["student"] == "learned graph"
    assert [json.loads(line)["kd"] for line in result.log.decode().splitlines()] == pytest.approx(
        [json.loads(line)["kd"] for line in reference.log.decode().splitlines()], rel=1e-4)
    for n in names:
        keep = pattern.expand(masks[n], tuple(dense[n].shape)).bool()
        assert torch.all(result.weights[n][~keep] == 0)
        moved = (reference.weights[n] - start[n])[keep]  # six AdamW steps of 1e-3 each, at most
        assert moved.abs().max() > 1e-3
        # a weight whose gradient is near zero may take an Adam step of either sign: all but a few agree
        close = ((result.weights[n] - reference.weights[n])[keep].abs() <= 1e-5).float().mean()
        assert close > 0.99, (n, float(close))
        assert torch.equal(learned.get_submodule(n).weight, dense[n])  # the teacher's weights, untouched
    assert all(s.selectors is None and s.delta is None for s in selectors.values())


def _cmd(*args):
    return [sys.executable, "-m", "gmc", *map(str, args)]


@pytest.fixture(scope="module")
def tiny_masks(tiny_model_dir, tmp_path_factory):
    """Wanda masks over ``tiny_model_dir`` (in process: only their being fixed matters), read only."""
    out = tmp_path_factory.mktemp("rec") / "wanda"
    done = invoke_gmc("prune", tiny_model_dir, "--method", "wanda", "--group", "1x64", "--calib", "bundled",
                      "--seq-len", "32", "--nsamples", "8", "--quiet", "-o", out)
    assert done.exit_code == 0, done.output
    return out


def _recover_cmd(artifact, out, *extra):
    return _cmd("recover", artifact, "--calib", "bundled", "--seq-len", "32", "--nsamples", "8", "--steps", "30",
                "--lr", "1e-3", "--checkpoint-every", "3", "--quiet", "-o", out, *extra)


@pytest.fixture(scope="module")
def recovered(tiny_masks, tmp_path_factory):
    """``gmc recover`` of ``tiny_masks`` run through in a child process on one thread: the artifact the CLI
    test checks and the reference the kill-and-resume tests must give bit for bit; read only."""
    out = tmp_path_factory.mktemp("recovered") / "rec"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(_recover_cmd(tiny_masks, out), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.slow
def test_recover_cli_writes_updated_weights_that_eval_uses(tiny_masks, recovered):
    artifact = load_artifact(recovered)
    assert artifact.manifest["weights_updated"] is True and artifact.manifest["recovery"]["steps"] == 30
    assert set(artifact.weights) == set(artifact.masks)
    assert (recovered / "recover_log.jsonl").is_file()
    assert not (recovered.parent / "rec.recover-ckpt").exists()
    source = load_artifact(tiny_masks)
    assert all(torch.equal(source.masks[n], artifact.masks[n]) for n in source.masks)


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_killed_then_resumed_recovery_is_bit_exact(tiny_masks, recovered, tmp_path, how):
    """``recovered``: the same command run through (one thread, as here), the reference."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    proc = subprocess.Popen(_recover_cmd(tiny_masks, out), env=env, stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(tmp_path / "run.recover-ckpt" / "state.pt", proc, 3)
    proc.send_signal(how)
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and not out.exists()
    resumed = subprocess.run(_recover_cmd(tiny_masks, out, "--resume"), env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    a, b = load_artifact(recovered), load_artifact(out)
    assert all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)
    assert (recovered / "recover_log.jsonl").read_text() == (out / "recover_log.jsonl").read_text()
