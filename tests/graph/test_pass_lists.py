"""Every command's route goes through the pass lists of ``gmc.graph.pipeline``: which lists ran, once
per program, for each backend (the fusion passes skipped only by ``LowerOptions.fuse``)."""
import pytest
from conftest import letters_tokenizer, mask_artifact, random_masks, tiny_model

import gmc.lower.compile
import gmc.masks.prune
from gmc.graph import pipeline
from gmc.groups import parse_pattern

PREPARE = ["insert_group_selectors"]
FOLD = ["insert_group_selectors", "fold_masks"]
LOWER = ["lower_group_sparse", "fuse_siblings", "fuse_gated_mlp", "fuse_attention", "tile_for_cuda"]


@pytest.fixture
def ran(monkeypatch):
    """``[[pass names]]`` of every ``run_passes`` call made while the test runs."""
    calls = []
    original = pipeline.run_passes

    def spy(gm, passes, run):
        skipped = () if run.options.fuse else pipeline.FUSE_PASSES
        calls.append([p.__name__ for p in passes if p not in skipped])
        return original(gm, passes, run)

    monkeypatch.setattr(pipeline, "run_passes", spy)
    return calls


@pytest.fixture
def artifact(tmp_path):
    from gmc.formats.artifact import save_artifact

    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    model.save_pretrained(tmp_path / "tiny")
    letters_tokenizer().save_pretrained(tmp_path / "tiny")
    spec = parse_pattern("1x16")
    return save_artifact(tmp_path / "masks", mask_artifact(model, random_masks(model, spec), spec,
                                                           str(tmp_path / "tiny")))


def test_prune_runs_prepare_then_the_rest_of_fold_for_save_dense(tmp_path, ran):
    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    model.save_pretrained(tmp_path / "tiny")
    letters_tokenizer().save_pretrained(tmp_path / "tiny")
    config = gmc.masks.prune.PruneConfig(str(tmp_path / "tiny"), str(tmp_path / "art"), method="magnitude",
                                         group="1x16", save_dense=str(tmp_path / "dense"))
    gmc.masks.prune.prune(config)
    assert ran == [PREPARE, FOLD[len(PREPARE):]]


@pytest.mark.parametrize("backend, compile_, expected", [
    ("dense", False, [FOLD]),
    ("torch", False, [LOWER]),
    ("torch", True, [LOWER, LOWER, LOWER]),  # the logits, prefill, decode programs
    # the masks folded; the model builder's ONNX graph is then packed by gmc.lower.onnx_pack, not traced
    pytest.param("onnx", False, [FOLD], marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_lower_runs_the_one_lowering_list_on_every_program(artifact, tmp_path, ran, monkeypatch, backend, compile_,
                                                           expected):
    from gmc.lower.stage import LowerConfig, lower_artifact

    compiled = []
    monkeypatch.setattr(gmc.lower.compile, "compile_programs", lambda programs, *a: compiled.append(programs))
    extra = {"compile": True, "max_len": 16} if compile_ else {}
    lower_artifact(LowerConfig(str(artifact), str(tmp_path / "out"), backend=backend, **extra))
    assert ran == expected
    assert [sorted(p) for p in compiled] == ([["decode", "prefill"]] if compile_ else [])


def test_fuse_option_skips_only_the_fusion_passes(ran):
    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    spec = parse_pattern("1x16")
    pipeline.lower(model, random_masks(model, spec), spec, options=pipeline.LowerOptions(fuse=False))
    assert ran == [["lower_group_sparse", "tile_for_cuda"]]
