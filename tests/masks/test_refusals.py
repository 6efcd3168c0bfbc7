"""Options that cannot apply to a run are refused in one line naming the option, not silently ignored.
An option counts as passed when it differs from its field's default."""
import dataclasses

import pytest

from gmc.errors import GmcError
from gmc.masks.learn import LearnConfig
from gmc.masks.prune import PruneConfig


def _config(tmp_path, method="groupmask", group="1x64", **overrides):
    return PruneConfig(model="tiny", output=str(tmp_path / "out"), method=method, group=group, **overrides)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("learn, option", [
    (dict(steps=10), "--steps"), (dict(lr=1e-3), "--lr"), (dict(lam=16.0), "--lam(bda)?"),
    (dict(budget="topk"), "--budget"), (dict(init="wanda"), "--init"), (dict(head="lowrank"), "--head"),
    (dict(learn_weights=True), "--learn-weights"), (dict(teacher_cache=False), "--no-teacher-cache"),
    (dict(checkpoint_every=5), "--checkpoint-every"), (dict(optim_8bit=True), "--optim-8bit"),
])
def test_learning_options_are_refused_for_one_shot_methods(tmp_path, method, learn, option):
    with pytest.raises(GmcError, match=f"^{option} applies to the learned methods .*not to --method {method}"):
        _config(tmp_path, method, learn=LearnConfig(**learn))


def test_resume_needs_a_run_to_continue(tmp_path):
    with pytest.raises(GmcError, match="^--resume continues a learned run or a recovery"):
        _config(tmp_path, "wanda", learn=LearnConfig(resume=True))
    _config(tmp_path, "wanda", recover_steps=2, learn=LearnConfig(resume=True))  # the recovery resumes


@pytest.mark.parametrize("learn, option", [(dict(head="lowrank"), "--head"), (dict(head="lowrank", rank=4), "--head")])
def test_the_hypernetwork_options_are_refused_for_free_logits(tmp_path, learn, option):
    with pytest.raises(GmcError, match=f"^{option} does not apply to --method direct"):
        _config(tmp_path, "direct", learn=LearnConfig(**learn))


def test_a_prior_applies_to_both_learned_methods(tmp_path):
    for method in ("groupmask", "direct"):
        assert _config(tmp_path, method, learn=LearnConfig(init="magnitude")).learn.init == "magnitude"


@pytest.mark.parametrize("learn, message", [
    (dict(rank=4), "^--rank sets the lowrank head's rank: it applies with --head lowrank"),
    (dict(weight_lr=1e-3), "^--weight-lr applies with --learn-weights"),
    (dict(budget="penalty", ramp=0.5), "^--ramp does not apply to --budget penalty"),
    (dict(budget="topk", lam=16.0), "^--lam(bda)? does not apply to --budget topk"),
    (dict(budget="topk", offset=1.0), "^--offset does not apply to --budget topk"),
])
def test_learning_options_of_another_setting_are_refused(learn, message):
    with pytest.raises(GmcError, match=message):
        LearnConfig(**learn)


def test_learning_options_of_the_chosen_setting_pass():
    LearnConfig(head="lowrank", rank=4, learn_weights=True, weight_lr=1e-3, budget="schedule", ramp=0.5, lam=16.0)
    LearnConfig(budget="topk", ramp=0.5)
    LearnConfig(budget="penalty", lam=16.0)


def test_recover_lr_needs_recover_steps(tmp_path):
    with pytest.raises(GmcError, match="^--recover-lr applies with --recover-steps"):
        _config(tmp_path, "wanda", recover_lr=1e-3)
    assert _config(tmp_path, "wanda", recover_steps=5, recover_lr=1e-3).recover_lr == 1e-3


@pytest.mark.parametrize("allocation", ["uniform", "owl"])
def test_allocation_is_refused_for_n_m(tmp_path, allocation):
    with pytest.raises(GmcError, match="^--allocation does not apply to the N:M pattern 2:4"):
        _config(tmp_path, "wanda", "2:4", allocation=allocation)


@pytest.mark.parametrize("data, option", [(dict(calib="bundled"), "--calib"), (dict(nsamples=8), "--nsamples"),
                                          (dict(seq_len=64), "--seq-len")])
def test_calibration_options_are_refused_where_no_data_is_read(tmp_path, data, option):
    with pytest.raises(GmcError, match=f"^{option} does not apply to --method magnitude: it reads no calibration"):
        _config(tmp_path, "magnitude", **data)
    _config(tmp_path, "magnitude", recover_steps=2, **data)  # recovery distils on calibration blocks


@pytest.mark.parametrize("method, group", [("groupmask", "1x64"), ("direct", "1x64"), ("magnitude", "1x64"),
                                           ("wanda", "2:4"), ("sparsegpt", "2:4"), ("magnitude", "32x32")])
def test_defaults_pass_and_a_validated_config_validates_again(tmp_path, method, group):
    """``gmc.prune_`` re-validates a copy of the config (``dataclasses.replace``): what validation fills in
    (allocation, nsamples, ...) must not read as passed options."""
    config = _config(tmp_path, method, group)
    again = dataclasses.replace(config, output=str(tmp_path / "other"))
    assert (again.allocation, again.nsamples) == (config.allocation, config.nsamples)
    assert config.allocation == (group if ":" in group else ("adaptive" if method in ("groupmask", "direct")
                                                             else "uniform"))
