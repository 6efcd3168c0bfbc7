"""The cached teacher: the same logits and KD as the live one, filled lazily, saved and reloaded safely."""
import json

import pytest
import torch
from conftest import CharTokenizer, set_selectors, tiny_model

from gmc.graph.pipeline import prepare
from gmc.graph.selector import masks_disabled
from gmc.graph.taps import block_outputs, with_outputs
from gmc.graph.targets import TargetFilter
from gmc.groups import GroupSpec
from gmc.inputs.model import LoadedModel
from gmc.masks.distill import soft_cross_entropy
from gmc.masks.learn import LearnConfig
from gmc.masks.prune import PruneConfig, prune
from gmc.masks.teacher import TEACHER_FILE, Teacher


def _graph(arch="llama"):
    spec = GroupSpec(1, 16)
    gm, targets, _ = prepare(tiny_model(arch), spec, TargetFilter())
    return gm, targets, spec


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cached_teacher_gives_the_live_logits_and_kd(arch):
    gm, targets, spec = _graph(arch)
    blocks = torch.randint(0, 300, (5, 12))
    live = Teacher(gm, blocks, "cpu", cache=False, precision="fp32")
    cached = Teacher(gm, blocks, "cpu", cache=True, precision="fp32")
    assert cached.cached and not live.cached
    generator = torch.Generator().manual_seed(0)
    set_selectors(gm, {t.name: (torch.rand(spec.grid(t.shape), generator=generator) > 0.5).float() for t in targets})
    for step in range(3):  # the second and third visits read the cache
        indices = torch.tensor([step % 2])
        batch = blocks[indices]
        with masks_disabled(gm), torch.no_grad():
            reference = gm(batch)
        assert torch.equal(cached.logits(indices, batch), reference)
        assert torch.equal(live.logits(indices, batch), reference)
        student = gm(batch)  # the selectors set above stay on outside the teacher
        assert torch.equal(soft_cross_entropy(student, cached.logits(indices, batch)),
                           soft_cross_entropy(student, reference))
    assert cached.filled.tolist() == [True, True, False, False, False]


def test_cached_teacher_gives_the_live_hidden_states_at_its_taps(tmp_path):
    """Layer-wise distillation: the taps come from the cache bit for bit, and are saved and reloaded with it."""
    gm, targets, spec = _graph()
    taps = block_outputs(gm)[:1]
    blocks = torch.randint(0, 300, (3, 10))
    live = Teacher(gm, blocks, "cpu", cache=False, precision="fp32", taps=taps)
    cached = Teacher(gm, blocks, "cpu", cache=True, precision="fp32", taps=taps, directory=tmp_path,
                     identity={"run": 1})
    set_selectors(gm, {t.name: torch.zeros(spec.grid(t.shape)) for t in targets})  # the student: all pruned
    indices = torch.tensor([2, 0])
    with masks_disabled(gm), torch.no_grad():
        logits, *hidden = with_outputs(gm, taps)(blocks[indices])
    for teacher in (live, cached, cached):  # the second cached call reads the cache
        got_logits, got_hidden = teacher.outputs(indices, blocks[indices])
        assert torch.equal(got_logits, logits) and len(got_hidden) == 1 and torch.equal(got_hidden[0], hidden[0])
    cached.save()
    again = Teacher(gm, blocks, "cpu", cache=True, precision="fp32", taps=taps, directory=tmp_path, identity={"run": 1})
    assert again.filled.tolist() == [True, False, True] and torch.equal(again.taps, cached.taps)
    # a cache written without taps is not read as one with them: recomputed
    without = Teacher(gm, blocks, "cpu", cache=True, precision="fp32", directory=tmp_path, identity={"run": 1})
    without.logits(indices, blocks[indices])
    without.dirty = True
    without.save()
    assert not Teacher(gm, blocks, "cpu", cache=True, precision="fp32", taps=taps, directory=tmp_path,
                       identity={"run": 1}).filled.any()


def test_cache_is_saved_only_when_filled_and_reloaded_only_for_its_run(tmp_path):
    gm, _, _ = _graph()
    blocks = torch.randint(0, 300, (4, 10))
    first = Teacher(gm, blocks, "cpu", cache=True, precision="fp32", directory=tmp_path, identity={"run": 1})
    first.save()
    assert not (tmp_path / TEACHER_FILE).exists()  # nothing filled yet
    first.logits(torch.tensor([2]), blocks[[2]])
    first.save()
    again = Teacher(gm, blocks, "cpu", cache=True, precision="fp32", directory=tmp_path, identity={"run": 1})
    assert again.filled.tolist() == [False, False, True, False]
    assert torch.equal(again.hidden, first.hidden) and not again.dirty
    other = Teacher(gm, blocks, "cpu", cache=True, precision="fp32", directory=tmp_path, identity={"run": 2})
    assert not other.filled.any()
    (tmp_path / TEACHER_FILE).write_bytes(b"\x80\x04 not a safetensors file")
    with pytest.raises(Exception):  # a corrupted cache is not loaded as anything else
        Teacher(gm, blocks, "cpu", cache=True, precision="fp32", directory=tmp_path, identity={"run": 1})


@pytest.mark.slow
def test_learned_masks_are_the_same_with_and_without_the_cache(tmp_path):
    """Batch 1, two epochs over 4 blocks: cached and live teachers train the same masks bit for bit."""
    artifacts = []
    for cache in (True, False):
        model = tiny_model("llama", hidden_size=128, intermediate_size=320)
        config = PruneConfig(model="tiny", output=str(tmp_path / f"out-{cache}"), group="1x64", sparsity=0.5,
                             calib="bundled", nsamples=4, seq_len=24, seed=0,
                             learn=LearnConfig(steps=10, lr=5e-3, progress=False, teacher_cache=cache))
        artifacts.append(prune(config, LoadedModel(model, CharTokenizer(), "tiny")))
    cached, live = artifacts
    assert cached.masks.keys() == live.masks.keys()
    assert all(torch.equal(cached.masks[n], live.masks[n]) for n in cached.masks)
    logs = [[json.loads(line) for line in (tmp_path / f"out-{cache}" / "train_log.jsonl").read_text().splitlines()]
            for cache in (True, False)]
    assert [r["kd"] for r in logs[0]] == [r["kd"] for r in logs[1]]
    assert len({r["kd"] for r in logs[0]}) > 5  # the distillation loss moved: the teachers were compared


def test_a_cache_over_the_limit_is_not_made(monkeypatch, capsys):
    from gmc.masks import teacher as module

    gm, _, _ = _graph()
    blocks = torch.randint(0, 300, (4, 10))
    monkeypatch.setattr(module, "CACHE_LIMIT", 4 * 10 * 64 * 4 - 1)  # one byte short of 4 blocks x 10 x hidden 64
    over = Teacher(gm, blocks, "cpu", cache=True, precision="fp32", progress=True)
    assert not over.cached and "teacher cache off" in capsys.readouterr().out
    monkeypatch.setattr(module, "CACHE_LIMIT", 4 * 10 * 64 * 4)
    assert Teacher(gm, blocks, "cpu", cache=True, precision="fp32").cached
