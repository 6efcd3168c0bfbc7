"""What a torchrun worker refuses before any collective or model load (the runs: test_distributed.py)."""
import pytest

from gmc.errors import GmcError
from gmc.masks.learn import LearnConfig
from gmc.masks.prune import PruneConfig
from gmc.masks.prune_distributed import check_distributed


def _config(tmp_path, **overrides):
    return PruneConfig(model="tiny", output=str(tmp_path / "out"), group="1x64", calib="bundled", **overrides)


@pytest.mark.parametrize("overrides,world_size,message", [
    ({"method": "wanda"}, 2, "--method wanda does not run under torchrun"),
    ({"learn": LearnConfig(batch_size=3)}, 2, "world size 2 does not divide --batch-size 3"),
    ({"save_dense": "dense", "learn": LearnConfig(batch_size=2)}, 2, "--save-dense is not available under torchrun"),
    ({"learn": LearnConfig(init="wanda")}, 1, "--init wanda is not available under torchrun"),
    ({"recover_steps": 5}, 1, "--recover-steps is not available under torchrun"),
])
def test_refusals_name_the_option(tmp_path, overrides, world_size, message):
    with pytest.raises(GmcError, match=message):
        check_distributed(_config(tmp_path, **overrides), world_size)


def test_a_learned_run_whose_batch_splits_evenly_passes(tmp_path):
    check_distributed(_config(tmp_path, learn=LearnConfig(batch_size=4)), 2)
