"""GroupMask learning on tiny models: budget, allocation, frozen weights, gradients, exact resume."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import (
    CharTokenizer,
    invoke_gmc,
    learn_cli_args,
    run_log,
    set_selectors,
    tiny_model,
    wait_for_checkpoint,
)

from gmc.errors import GmcError
from gmc.graph.passes.find_targets import find_targets
from gmc.graph.passes.insert_group_selectors import insert_group_selectors
from gmc.graph.selector import masks_disabled
from gmc.graph.taps import block_outputs, with_outputs
from gmc.graph.trace import trace_model
from gmc.groups import GroupSpec
from gmc.inputs.model import LoadedModel
from gmc.masks.distill import hidden_distance, soft_cross_entropy
from gmc.masks.harness import batch_indices
from gmc.masks.hypernet import HyperNetwork, export_selectors, relaxed_selectors
from gmc.masks.learn import LearnConfig
from gmc.masks.prune import PruneConfig, prune
from gmc.masks.student import COMPILE_MIN_STEPS, Student, adamw, autocast, compiles_step, lr_scale, resolve_precision

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]  # on CUDA, --precision auto trains in bf16


def _run(tmp_path, steps=60, allocation=None, method="groupmask", seed=0, device="cpu", **learn):
    model = tiny_model("llama", hidden_size=128, intermediate_size=320).to(device)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    config = PruneConfig(model="tiny", output=str(tmp_path / "out"), method=method, group="1x64",
                         sparsity=0.5, allocation=allocation, calib="bundled", nsamples=8, seq_len=32,
                         seed=seed, device=device, dtype="float32",
                         learn=LearnConfig(steps=steps, lr=5e-3, progress=False, **learn))
    artifact = prune(config, LoadedModel(model, CharTokenizer(), "tiny"))
    return artifact, model, before


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_adaptive_run_meets_budget_with_unequal_layers_and_frozen_weights(tmp_path, device):
    artifact, model, before = _run(tmp_path, device=device)
    manifest = artifact.manifest
    assert abs(manifest["global_sparsity"] - 0.5) <= 0.01
    assert len({round(v, 4) for v in manifest["layer_sparsity"].values()}) > 1
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())  # bit-identical
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 61))
    assert log[-1]["sparsity"] > 0.4  # the training masks moved to the budget, not just the export
    assert manifest["method"] == "groupmask" and manifest["training"]["trainable_parameters"] > 0
    assert not (tmp_path / "out.ckpt").exists()  # checkpoints are cleaned up after success


def test_uniform_allocation_pins_every_layer(tmp_path):
    artifact, _, _ = _run(tmp_path, allocation="uniform")
    for name, value in artifact.manifest["layer_sparsity"].items():
        assert abs(value - 0.5) <= 0.02, name


def test_direct_ablation_runs(tmp_path):
    with pytest.warns(RuntimeWarning, match="training ended at"):  # N(0, 1) + 3 logits: 30 steps prune little
        artifact, _, _ = _run(tmp_path, method="direct", steps=30, budget="penalty")
    assert abs(artifact.manifest["global_sparsity"] - 0.5) <= 0.005  # export threshold if needed


def test_export_moves_one_threshold_when_training_is_too_short(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"training ended at 0\.\d% sparsity for a 50% target"):
        artifact, _, _ = _run(tmp_path, steps=1, budget="penalty")
    assert abs(artifact.manifest["global_sparsity"] - 0.5) <= 0.005
    assert "global" in artifact.manifest["export_thresholds_moved"]
    assert artifact.manifest["trained_sparsity"] < 0.05


# topk holds the scheduled budget exactly at every step by construction (the hard forward is the
# ranking at that step's budget, whatever the logits), so its long run repeats its short one; the
# schedule budget follows its target through the penalty until the landing, in short and long runs.
@pytest.mark.parametrize("allocation,budget,steps", [
    ("adaptive", "schedule", 50), ("adaptive", "schedule", 500),
    ("uniform", "schedule", 50), ("uniform", "schedule", 500),
    ("adaptive", "topk", 50),
])
@pytest.mark.slow
def test_budget_lands_at_the_designed_step_for_short_and_long_runs(tmp_path, steps, allocation, budget):
    # eager: a 500-step run would compile its step (--compile-step auto), which the budget does not depend on
    artifact, _, _ = _run(tmp_path, steps=steps, allocation=allocation, ramp=0.5, budget=budget, lam=64.0,
                          compile_step="off")
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert log[steps // 8]["sparsity"] < 0.45  # ramping, not there at once
    # topk holds the target from the end of the ramp on; schedule from the landing (last tenth) on
    landed = steps // 2 if budget == "topk" else steps - steps // 10
    for record in log[landed:]:
        assert abs(record["sparsity"] - 0.5) <= 0.005, record
    manifest = artifact.manifest
    assert abs(manifest["global_sparsity"] - 0.5) <= 0.005 and manifest["export_thresholds_moved"] == {}
    assert abs(manifest["trained_sparsity"] - 0.5) <= 0.005


@pytest.mark.slow
@pytest.mark.parametrize("init", ["magnitude", "wanda"])
@pytest.mark.parametrize("method,head", [("groupmask", "full"), ("groupmask", "lowrank"), ("direct", "full")])
def test_prior_makes_the_untrained_export_the_heuristic_mask(tmp_path, init, method, head):
    from gmc.graph.selector import selector_modules
    from gmc.inputs.calib import described_blocks, load_texts
    from gmc.masks.heuristics import heuristic_masks
    from gmc.masks.sources.magnitude import magnitude_scores
    from gmc.masks.sources.wanda import activation_norms, wanda_scores

    model = tiny_model("llama", hidden_size=128, intermediate_size=320)
    config = PruneConfig(model="tiny", output=str(tmp_path / "out"), method=method, group="1x64", sparsity=0.5,
                         calib="bundled", nsamples=8, seq_len=32, seed=0,
                         learn=LearnConfig(steps=1, lr=1e-12, progress=False, init=init, head=head, ramp=0.0))
    loaded = LoadedModel(model, CharTokenizer(), "tiny")
    artifact = prune(config, loaded)
    gm = trace_model(model)
    targets = find_targets(gm)
    insert_group_selectors(gm, targets, config.pattern)
    blocks, _ = described_blocks(loaded, load_texts(config.calib, split="train"), config.seq_len, config.nsamples,
                                 config.seed)
    weights = {t.name: gm.get_parameter(t.node.args[1].target) for t in targets}
    scores = (magnitude_scores(weights) if init == "magnitude"
              else wanda_scores(weights, activation_norms(gm, selector_modules(gm), blocks)))
    expected = heuristic_masks(scores, config.pattern, 0.5, "uniform")
    for name, mask in expected.items():
        assert torch.equal(artifact.masks[name], mask), name


def test_straight_through_gradient_reaches_every_head_and_teacher_builds_no_graph():
    gm, targets, hyper = _selector_graph()
    ids = torch.randint(0, 320, (1, 8))
    with torch.no_grad(), masks_disabled(gm):
        teacher = gm(ids)
    assert teacher.grad_fn is None and not teacher.requires_grad
    hard = [relaxed_selectors(logit, 0.4, 3.0, None) for logit in hyper()]
    assert all(set(h.detach().unique().tolist()) <= {0.0, 1.0} for h in hard)
    set_selectors(gm, {t.name: h for t, h in zip(targets, hard)})
    # at init every group is kept, student == teacher and the KD gradient is exactly zero:
    # the budget term is what moves the selectors first, and both reach every head
    kept = torch.stack([h.sum() for h in hard]).sum() / sum(h.numel() for h in hard)
    (soft_cross_entropy(gm(ids), teacher) + 16 * (kept / 0.5).log().abs()).backward()
    for head in hyper.heads:
        assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in gm.parameters())


def test_layer_loss_alone_reaches_the_selectors_up_to_the_tapped_block():
    """The hidden-state loss at block 0's output moves the selectors of block 0's targets, and no others."""
    gm, targets, hyper = _selector_graph()
    taps = block_outputs(gm)[:1]
    tapped = with_outputs(gm, taps)
    ids = torch.randint(0, 320, (1, 8))
    with torch.no_grad(), masks_disabled(gm):
        _, teacher = tapped(ids)
    leaves = [logit.detach().requires_grad_() for logit in hyper()]
    # half of every target's groups off, so the student differs from the teacher
    hard = [relaxed_selectors(leaf - torch.quantile(leaf.detach(), 0.5) - 3.0, 0.4, 3.0, None) for leaf in leaves]
    set_selectors(gm, {t.name: h for t, h in zip(targets, hard)})
    _, student = tapped(ids)
    loss = hidden_distance([student], [teacher])
    assert loss > 0
    loss.backward()
    for target, leaf in zip(targets, leaves):
        reached = leaf.grad is not None and leaf.grad.abs().sum() > 0
        assert reached == (".layers.0." in target.name), target.name


def test_hidden_distance_is_relative_per_token():
    teacher = torch.tensor([[[3.0, 4.0], [300.0, 400.0]]])  # norms 5 and 500
    student = teacher + torch.tensor([[[0.5, 0.0], [0.5, 0.0]]])  # the same absolute error on both tokens
    assert torch.allclose(hidden_distance([student], [teacher]), torch.tensor((0.25 / 25 + 0.25 / 250000) / 2))
    assert hidden_distance([teacher, teacher], [teacher, teacher]) == 0


@pytest.mark.slow
def test_layer_kd_run_logs_its_loss_and_learns_other_masks(tmp_path):
    plain, _, _ = _run(tmp_path / "plain", steps=30)
    layered, _, _ = _run(tmp_path / "layered", steps=30, layer_kd=4.0)
    logs = {run: [json.loads(line) for line in (tmp_path / run / "out" / "train_log.jsonl").read_text().splitlines()]
            for run in ("plain", "layered")}
    assert "layer" not in logs["plain"][-1] and logs["layered"][-1]["layer"] > 0
    assert logs["layered"][-1]["loss"] > logs["layered"][-1]["kd"]  # the layer term is in the loss
    assert any(not torch.equal(plain.masks[n], layered.masks[n]) for n in plain.masks)
    assert abs(layered.manifest["global_sparsity"] - 0.5) <= 0.01


@pytest.mark.parametrize("values, message", [
    (dict(layer_kd=-1.0), "bad --layer-kd -1.0"),
    (dict(layer_kd=float("nan")), "bad --layer-kd nan"),
    (dict(layer_kd_every=2), "--layer-kd-every applies with --layer-kd"),
    (dict(layer_kd=1.0, layer_kd_every=0), "bad --layer-kd-every 0"),
])
def test_bad_layer_kd_settings_are_refused(values, message):
    with pytest.raises(GmcError, match=message):
        LearnConfig(**values)


@pytest.mark.parametrize("values, message", [
    (dict(offset=-1.0), "bad --offset -1.0"),
    (dict(offset=float("inf")), "bad --offset inf"),
    (dict(budget="topk", offset=1.0), "--offset does not apply to --budget topk"),
])
def test_bad_offset_settings_are_refused(values, message):
    with pytest.raises(GmcError, match=message):
        LearnConfig(**values)


@pytest.mark.slow
def test_a_smaller_offset_starts_dropping_groups_sooner(tmp_path):
    """--offset is the margin the logits start above the threshold: the penalty crosses a smaller one sooner."""
    sparsity = {}
    for offset in (3.0, 0.5):
        _run(tmp_path / str(offset), steps=30, offset=offset, ramp=0.5)
        lines = (tmp_path / str(offset) / "out" / "train_log.jsonl").read_text().splitlines()
        sparsity[offset] = [json.loads(line)["sparsity"] for line in lines]
    assert sparsity[0.5][4] > sparsity[3.0][4] + 0.05
    assert abs(sparsity[0.5][-1] - 0.5) <= 0.01  # both land on the budget (the top-k landing)


def test_relaxation_and_export_never_empty_a_structure():
    logits = torch.full((3, 4), -10.0)
    logits[1, 2] = -9.0
    assert export_selectors(logits, 3.0).sum() == 1 and export_selectors(logits, 3.0)[1, 2]
    assert relaxed_selectors(logits, 0.4, 3.0, None).sum() == 1
    generator = torch.Generator().manual_seed(0)
    noisy = relaxed_selectors(torch.zeros(50, 50), 0.4, 3.0, generator)
    assert 0.5 < float(noisy.mean()) < 1.0  # logistic noise flips some of the offset-kept groups


def test_soft_cross_entropy_matches_plain_formula_and_gradient():
    student = torch.randn(2, 5, 11, requires_grad=True)
    teacher = torch.randn(2, 5, 11)
    chunked = soft_cross_entropy(student, teacher, chunk=3)
    plain = -(torch.softmax(teacher, -1) * torch.log_softmax(student, -1)).sum(-1).mean()
    torch.testing.assert_close(chunked, plain)
    (grad_chunked,) = torch.autograd.grad(chunked, student)
    (grad_plain,) = torch.autograd.grad(plain, student)
    torch.testing.assert_close(grad_chunked, grad_plain)


def test_batch_order_is_a_seeded_permutation_per_epoch():
    first_epoch = torch.cat([batch_indices(s, 2, 6, 42) for s in (1, 2, 3)])
    assert sorted(first_epoch.tolist()) == list(range(6))
    assert torch.equal(batch_indices(2, 2, 6, 42), batch_indices(2, 2, 6, 42))
    assert not torch.equal(first_epoch, torch.cat([batch_indices(s, 2, 6, 42) for s in (4, 5, 6)]))


def _nan_loss_at(patch, call: int) -> None:
    """Make the learner's ``call``-th loss (counting from 1) NaN, through ``patch`` (a monkeypatch)."""
    import gmc.masks.training

    real = gmc.masks.training.soft_cross_entropy
    calls = {"n": 0}

    def poisoned(student, teacher, chunk=512):
        calls["n"] += 1
        loss = real(student, teacher, chunk)
        return loss * float("nan") if calls["n"] == call else loss

    patch.setattr(gmc.masks.training, "soft_cross_entropy", poisoned)


def test_nan_loss_stops_with_clear_error_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    _nan_loss_at(monkeypatch, 5)
    with pytest.raises(GmcError, match=r"loss became nan at step 5; stopped.*--resume"):
        _run(tmp_path, steps=10, checkpoint_every=2)
    state = torch.load(tmp_path / "out.ckpt" / "state.pt", weights_only=True)
    assert state["step"] == 4
    assert not (tmp_path / "out").exists()  # no half-written artifact


def _prune_cmd(model_dir, out, *extra):
    return [sys.executable, "-m", "gmc", *learn_cli_args(model_dir, out, *extra)]


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_killed_then_resumed_run_gives_identical_masks(tiny_model_dir, learned_run, tmp_path, how):
    """``learned_run`` is the uninterrupted run of the same command (one thread, as here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    # a suite started in the background (`pytest &`) ignores SIGINT, and children inherit that
    proc = subprocess.Popen(_prune_cmd(tiny_model_dir, out), env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for_checkpoint(tmp_path / "run.ckpt" / "state.pt", proc, 4)
    proc.send_signal(how)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode != 0 and not out.exists()
    if how != signal.SIGKILL:  # Ctrl-C and SIGTERM write a checkpoint at the last finished step and say so
        assert proc.returncode == 128 + how and "--resume" in stderr
    resumed = subprocess.run(_prune_cmd(tiny_model_dir, out, "--resume"), env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr

    from gmc.formats.artifact import load_artifact

    a, b = load_artifact(learned_run), load_artifact(out)
    assert all(torch.equal(a.masks[n], b.masks[n]) for n in a.masks)
    assert run_log(learned_run) == run_log(out)


def test_signals_during_training_wait_for_the_end_of_the_step():
    """The first SIGINT/SIGTERM only sets a flag (read after each step), a second one stops at once,
    an ignored SIGINT stays ignored, and the previous handlers come back afterwards."""
    from gmc.masks.harness import deferred_stop

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # SIG_IGN under `pytest &`
    try:
        _check_deferred_stop(deferred_stop)
    finally:
        signal.signal(signal.SIGINT, inherited)


def _check_deferred_stop(deferred_stop):
    before = signal.getsignal(signal.SIGTERM)
    with deferred_stop(enabled=True) as requested:
        os.kill(os.getpid(), signal.SIGTERM)
        assert requested == [signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job
    try:
        with deferred_stop(enabled=True) as requested:
            os.kill(os.getpid(), signal.SIGINT)
            assert requested == []
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)

    with deferred_stop(enabled=False) as requested:  # distributed: ranks must stop together
        assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_resume_refuses_a_different_run(tiny_model_dir, tmp_path, monkeypatch):
    """In process: a run of the kill-and-resume command stopped after its checkpoint of step 4 (a nan
    loss at step 5, which keeps the checkpoint) leaves what a killed one does; the refusals read it."""
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        _nan_loss_at(patch, 5)
        stopped = invoke_gmc(*learn_cli_args(tiny_model_dir, out))
    assert stopped.exit_code == 2 and not out.exists(), stopped.output
    assert torch.load(tmp_path / "run.ckpt" / "state.pt", weights_only=True)["step"] == 4
    result = invoke_gmc(*learn_cli_args(tiny_model_dir, out, "--resume", "--sparsity", "0.6"))
    assert result.exit_code == 2 and "belongs to a different run: sparsity" in result.stderr
    again = invoke_gmc(*learn_cli_args(tiny_model_dir, out))
    assert again.exit_code == 2 and "pass --resume" in again.stderr


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_learned_weights_keep_pruned_entries_zero_and_the_teacher_pretrained(tmp_path, device):
    frozen, _, _ = _run(tmp_path / "frozen", steps=40, device=device)
    artifact, model, before = _run(tmp_path / "weights", steps=40, learn_weights=True, weight_lr=2e-3, device=device)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())  # the deltas live apart
    assert artifact.weights.keys() == artifact.masks.keys()
    for name, mask in artifact.masks.items():
        weight, original = artifact.weights[name], before[f"{name}.weight"].cpu()
        kept = artifact.pattern.expand(mask.float(), tuple(weight.shape)).bool()
        assert torch.all(weight[~kept] == 0)  # exactly zero where pruned
        assert not torch.equal(weight[kept], original[kept])  # the kept weights moved
    assert (tmp_path / "weights" / "out" / "weights.safetensors").is_file()
    kd = {}
    for run in ("frozen", "weights"):
        log = [json.loads(line) for line in (tmp_path / run / "out" / "train_log.jsonl").read_text().splitlines()]
        kd[run] = sum(r["kd"] for r in log[-10:]) / 10
    assert kd["weights"] < kd["frozen"]  # same seed and blocks: the adapted weights distil better


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the penalty reached")  # 8 steps land by top-k alone
def test_recovery_after_learned_weights_starts_from_them(tmp_path):
    """``--learn-weights --recover-steps``: the recovery tunes the jointly learned weights under the landed
    masks, not the pretrained ones: one AdamW step moves each weight by at most its rate."""
    def run(name, recover_steps):
        model = tiny_model("llama", hidden_size=128, intermediate_size=320)
        before = {n: p.clone() for n, p in model.state_dict().items()}
        config = PruneConfig(model="tiny", output=str(tmp_path / name), method="groupmask", group="1x64",
                             sparsity=0.5, calib="bundled", nsamples=8, seq_len=32, seed=0, device="cpu",
                             dtype="float32", recover_steps=recover_steps, recover_lr=1e-4,
                             learn=LearnConfig(steps=8, lr=5e-3, learn_weights=True, weight_lr=2e-3, progress=False))
        return prune(config, LoadedModel(model, CharTokenizer(), "tiny")), before

    joint, before = run("joint", 0)
    tuned, _ = run("tuned", 1)
    assert "recovery" in tuned.manifest and tuned.manifest["training"]["learn_weights"]
    for name, mask in joint.masks.items():
        assert torch.equal(tuned.masks[name], mask)
        kept = joint.pattern.expand(mask.float(), tuple(joint.weights[name].shape)).bool()
        pretrained = before[f"{name}.weight"] * kept
        assert (joint.weights[name] - pretrained).abs().max() > 5e-4  # the joint run moved the kept weights
        assert (tuned.weights[name] - joint.weights[name]).abs().max() <= 1.01e-4  # one step from them
        assert torch.all(tuned.weights[name][~kept] == 0)
    assert any(not torch.equal(tuned.weights[n], joint.weights[n]) for n in joint.weights)  # recovery moved them


@pytest.mark.slow
def test_killed_recovery_after_a_joint_run_resumes_bit_exactly(tiny_model_dir, tmp_path):
    """Killed in the recovery phase (``--learn-weights --recover-steps``), the run resumes from the
    recovery's own checkpoint (``--checkpoint-every`` applies to both phases) and ends as an
    uninterrupted one does."""
    options = ("--learn-weights", "--recover-steps", "60")  # seconds of recovery: caught between checkpoints
    reference, out = _reference_and_killed_run(tiny_model_dir, tmp_path, options, "run.recover-ckpt")
    assert not out.exists() and torch.load(tmp_path / "run.recover-ckpt" / "state.pt", weights_only=True)["step"] < 60
    _resume_to_the_same_masks_and_weights(tiny_model_dir, reference, out, options)
    assert (reference / "recover_log.jsonl").read_text() == (out / "recover_log.jsonl").read_text()


def _reference_and_killed_run(model_dir, tmp_path, options, checkpoint: str):
    """The learned run of ``options`` run through (``tmp_path/reference``) and the same run SIGKILLed once
    ``tmp_path/checkpoint`` holds step 4 (``tmp_path/run``), both on one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference = tmp_path / "reference"
    done = subprocess.run(_prune_cmd(model_dir, reference, *options), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "run"
    proc = subprocess.Popen(_prune_cmd(model_dir, out, *options), env=env, stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(tmp_path / checkpoint / "state.pt", proc, 4)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    return reference, out


def _resume_to_the_same_masks_and_weights(model_dir, reference, out, options) -> None:
    """``--resume`` the killed run at ``out``: its masks and learned weights are ``reference``'s bit for bit."""
    from gmc.formats.artifact import load_artifact

    resumed = subprocess.run(_prune_cmd(model_dir, out, *options, "--resume"),
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    a, b = load_artifact(reference), load_artifact(out)
    assert a.weights and all(torch.equal(a.masks[n], b.masks[n]) for n in a.masks)
    assert all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)


@pytest.mark.parametrize("option", ["learn_weights", "layer_kd"])
def test_single_process_options_are_refused_under_torchrun(option):
    from gmc.masks.training import _check_launch

    class Dist:
        world_size = 2

    with pytest.raises(GmcError, match=f"--{option.replace('_', '-')}"):
        _check_launch(LearnConfig(**{option: True if option == "learn_weights" else 1.0}), Dist())


@pytest.mark.slow
def test_killed_learn_weights_and_layer_kd_run_resumes_bit_exactly(tiny_model_dir, tmp_path):
    """Learned weights, layer-wise distillation (the teacher cache then holds the tapped hidden states) and
    a decaying learning rate (a function of the step)."""
    options = ("--learn-weights", "--weight-lr", "1e-3", "--layer-kd", "2", "--layer-kd-every", "1",
               "--lr-decay", "cosine")
    reference, out = _reference_and_killed_run(tiny_model_dir, tmp_path, options, "run.ckpt")
    assert (tmp_path / "run.ckpt" / "teacher.safetensors").is_file()
    _resume_to_the_same_masks_and_weights(tiny_model_dir, reference, out, options)
    assert run_log(reference) == run_log(out) and "layer" in run_log(out)[-1]


@pytest.mark.parametrize("decay", ["none", "cosine"])
def test_every_step_updates_at_the_decayed_rate_of_both_groups(tmp_path, monkeypatch, decay):
    """The mask source's and the weight deltas' rates follow ``lr_scale`` step by step (steps are 1-based)."""
    import gmc.masks.training as training

    rates = []

    def recording_adamw(*args, **kwargs):
        optimizer = adamw(*args, **kwargs)
        step = optimizer.step
        optimizer.step = lambda: (rates.append([g["lr"] for g in optimizer.param_groups]), step())[1]
        return optimizer

    monkeypatch.setattr(training, "adamw", recording_adamw)
    _run(tmp_path, steps=12, learn_weights=True, weight_lr=2e-4, lr_decay=decay)
    want = [[5e-3 * lr_scale(k, 12, decay), 2e-4 * lr_scale(k, 12, decay)] for k in range(1, 13)]
    torch.testing.assert_close(torch.tensor(rates, dtype=torch.float64), torch.tensor(want, dtype=torch.float64))
    if decay == "cosine":
        assert rates[0] == [5e-3, 2e-4] and rates[-1][0] < 1e-4 and rates == sorted(rates, reverse=True)


def test_adamw_is_fused_with_and_without_parameter_groups():
    """One pass per tensor on the host, whether the learner passes tensors or groups (mask source + deltas)."""
    head, delta = torch.nn.Linear(4, 8), torch.zeros(3, 3, requires_grad=True)
    assert adamw(list(head.parameters()), "cpu", False, lr=1e-3).defaults["fused"]
    grouped = adamw([{"params": list(head.parameters())}, {"params": [delta], "lr": 1e-4}], "cpu", False, lr=1e-3)
    assert grouped.defaults["fused"]


def _selector_graph(device: str = "cpu"):
    """A tiny traced Llama with 1x16 selectors and a hypernetwork over them."""
    model = tiny_model("llama").to(device)
    gm = trace_model(model)
    targets = find_targets(gm)
    spec = GroupSpec(1, 16)
    insert_group_selectors(gm, targets, spec)
    return gm, targets, HyperNetwork([spec.grid(t.shape) for t in targets], head="full").to(device)


def _kd_gradients(student, gm, targets, hyper, ids, drop: float, precision: str = "fp32"):
    """KD gradients of the selector logits, with a ``drop`` fraction of each target's groups off."""
    with torch.no_grad(), masks_disabled(gm):
        teacher = gm(ids)
    leaves = [logit.detach().requires_grad_() for logit in hyper()]
    hard = [relaxed_selectors(leaf - torch.quantile(leaf.detach(), drop) - 3.0, 0.4, 3.0, None) for leaf in leaves]
    set_selectors(gm, {t.name: h for t, h in zip(targets, hard)})
    with autocast(ids.device.type, precision):
        kd = soft_cross_entropy(student(ids), teacher)
    kd.backward()
    set_selectors(gm, {t.name: None for t in targets})
    return kd.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_and_eager_steps_give_the_same_gradients(device):
    """Two steps with different selectors: the compiled student reads each step's selectors, and its
    loss and selector gradients are the eager ones to float rounding."""
    gm, targets, hyper = _selector_graph(device)
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    eager, compiled = Student(gm, compiled=False), Student(gm, compiled=True)
    for drop in (0.3, 0.6):
        kd_eager, grads_eager = _kd_gradients(eager, gm, targets, hyper, ids, drop)
        kd_compiled, grads_compiled = _kd_gradients(compiled, gm, targets, hyper, ids, drop)
        assert compiled.compiled is not None  # no fallback to eager
        assert kd_eager > 0
        torch.testing.assert_close(kd_compiled, kd_eager, rtol=1e-4, atol=1e-6)
        for got, want in zip(grads_compiled, grads_eager):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_step_backpropagates_and_follows_the_fp32_gradients(device):
    """Under bf16 autocast the masked linears' backward runs its products in bf16 too (grad_out is
    bf16); the selector gradients keep the fp32 ones' direction."""
    gm, targets, hyper = _selector_graph(device)
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    student = Student(gm, compiled=False)
    kd32, grads32 = _kd_gradients(student, gm, targets, hyper, ids, 0.5, "fp32")
    kd16, grads16 = _kd_gradients(student, gm, targets, hyper, ids, 0.5, "bf16")
    assert abs(float(kd16 - kd32)) < 0.02 * float(kd32)
    flat32, flat16 = torch.cat([g.flatten() for g in grads32]), torch.cat([g.flatten() for g in grads16])
    assert torch.nn.functional.cosine_similarity(flat32, flat16, dim=0) > 0.98


def test_a_step_that_fails_to_compile_runs_eager_and_says_so(monkeypatch, capsys):
    def broken(model):
        def call(batch):
            raise RuntimeError("InductorError: no working C++ compiler\nmore detail")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    model = torch.nn.Linear(3, 2)
    student = Student(model, compiled=True)
    x = torch.randn(4, 3)
    torch.testing.assert_close(student(x), model(x))
    assert student.compiled is None
    captured = capsys.readouterr()
    assert "compiling the training step failed (InductorError: no working C++ compiler); running it eager" in \
        captured.out + captured.err


@pytest.mark.parametrize("precision, device, want", [
    ("fp32", "cpu", "fp32"), ("bf16", "cpu", "bf16"), ("auto", "cuda", "bf16"), ("auto", "cpu", "fp32"),
])
def test_precision_resolves_by_device(precision, device, want):
    assert resolve_precision(precision, device) == want


@pytest.mark.parametrize("steps, recover, choice, dist, want", [
    (COMPILE_MIN_STEPS, 0, "auto", None, True), (COMPILE_MIN_STEPS - 1, 0, "auto", None, False),
    (COMPILE_MIN_STEPS - 100, 100, "auto", None, True), (COMPILE_MIN_STEPS - 100, 99, "auto", None, False),
    (10, 0, "on", None, True), (10**5, 0, "off", None, False), (10**5, 0, "on", object(), False),
])
def test_compile_step_choice(steps, recover, choice, dist, want):
    """auto counts the recovery steps that continue on the learned graph: they reuse its compiled step."""
    assert compiles_step(LearnConfig(steps=steps, compile_step=choice), dist, recover) is want


@pytest.mark.parametrize("option, value", [("--precision", "fp16"), ("--compile-step", "yes"), ("--lr-decay", "step")])
def test_bad_choice_of_a_learning_option_is_a_usage_error(tmp_path, option, value):
    result = invoke_gmc(["prune", "smollm2-135m", "-o", str(tmp_path / "o"), option, value])
    assert result.exit_code == 2 and value in result.output


@pytest.mark.parametrize("group", ["1x64", "32x32", "4x48"])
def test_budget_counts_sparsity_as_the_manifest_does(group):
    """The export measures sparsity on the training budget's group sizes; on ragged shapes it is
    the manifest's count (``gmc.groups``) exactly, globally and per target."""
    from gmc.groups import global_sparsity, layer_sparsity, parse_pattern
    from gmc.masks.budget import Budget

    pattern = parse_pattern(group)
    shapes = {"a": (96, 200), "b": (200, 576), "c": (33, 70)}
    generator = torch.Generator().manual_seed(0)
    masks = {n: torch.rand(pattern.grid(s), generator=generator) > 0.4 for n, s in shapes.items()}
    budget = Budget(list(shapes), [pattern.group_sizes(s).float() for s in shapes.values()], 0.5, "adaptive", None)
    assert budget.sparsity_of(list(masks.values())) == global_sparsity(pattern, masks, shapes)
    for index, (name, shape) in enumerate(shapes.items()):
        assert budget.target_sparsity(index, masks[name]) == pytest.approx(
            layer_sparsity(pattern, masks[name], shape), abs=1e-15)


def test_prune_under_torchrun_names_the_distributed_entry(tmp_path, monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    config = PruneConfig(model="tiny", output=str(tmp_path / "out"), group="1x64", calib="bundled")
    with pytest.raises(GmcError, match="prune_distributed"):
        prune(config)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_penalty_that_stops_short_of_the_budget_before_the_landing_warns(tmp_path):
    """--budget schedule: when the penalty has not carried the logits across the threshold by the landing, the
    landing's top-k drops the rest at once; the manifest keeps the sparsity it started from, and gmc warns."""
    with pytest.warns(RuntimeWarning, match=r"the penalty reached \d+\.\d% sparsity for a 50% target before the "
                                            r"landing .*\(--offset, 40 in this run\)"):
        far, _, _ = _run(tmp_path / "far", steps=20, offset=40.0)
    assert far.manifest["sparsity_before_landing"] < 0.45
    assert abs(far.manifest["global_sparsity"] - 0.5) <= 0.01  # the landing still meets the budget
    near, _, _ = _run(tmp_path / "near", steps=60)
    assert near.manifest["sparsity_before_landing"] > 0.45
