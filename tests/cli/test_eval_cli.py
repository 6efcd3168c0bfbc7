"""``gmc eval`` on a tiny checkpoint and a masks artifact of it: one-line errors, side-by-side results, local tasks."""
import json

import pytest
from conftest import (
    invoke_gmc,
    save_random_artifact,
    save_tiny_smol,
    tiny_smol_model,
    write_mc_task,
    write_text,
)


def one_line_error(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gmc: error: ") and fragment in lines[0], lines


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_cli")
    checkpoint = save_tiny_smol(root / "dense")
    artifact = save_random_artifact(root / "masks", str(checkpoint), tiny_smol_model(), keep=0.5)
    return root, checkpoint, artifact, write_text(root / "text.txt", paragraphs=12)


def test_bad_refs_and_options_fail_fast_on_one_line(workspace, tmp_path):
    root, checkpoint, _, text = workspace
    (tmp_path / "empty").mkdir()
    one_line_error(invoke_gmc("eval", tmp_path / "missing"), "model or artifact not found")
    one_line_error(invoke_gmc("eval", tmp_path / "empty"), "not a model")
    one_line_error(invoke_gmc("eval", checkpoint, "--ppl", text, "--seq-len", 1), "bad --seq-len 1")
    one_line_error(invoke_gmc("eval", checkpoint, "--ppl", text, "--stride", 0), "bad --stride 0")
    one_line_error(invoke_gmc("eval", checkpoint, "--ppl", text, "--seq-len", "x"), "--seq-len")
    one_line_error(invoke_gmc("eval", checkpoint, "--ppl", "nope"), "unknown text source 'nope'")
    one_line_error(invoke_gmc("eval", checkpoint, "--ppl", root / "none.txt"), "text file not found")
    one_line_error(invoke_gmc("eval", checkpoint, "--tasks", "a", "--limit", "abc"), "bad --limit 'abc'")
    one_line_error(invoke_gmc("eval", checkpoint, "--tasks", "a", "--include-path", tmp_path / "no"), "--include-path")
    one_line_error(invoke_gmc("eval", checkpoint, "--limit", "5"), "add --tasks")
    one_line_error(invoke_gmc("eval", checkpoint, "--dtype", "int4"), "--dtype")
    one_line_error(invoke_gmc("eval"), "Missing argument")


@pytest.mark.slow
def test_eval_dense_and_masks_side_by_side(workspace, tmp_path):
    _, checkpoint, artifact, text = workspace
    out = tmp_path / "results.json"

    result = invoke_gmc("eval", checkpoint, artifact, "--ppl", text, "--seq-len", 32, "-o", out)

    assert result.exit_code == 0, result.output
    models = json.loads(out.read_text())["models"]
    assert [m["ref"] for m in models] == [str(checkpoint), str(artifact)]
    assert models[1]["perplexity"] != models[0]["perplexity"]
    assert models[1]["protocol"]["perplexity"]["seq_len"] == 32
    markdown = out.with_suffix(".md").read_text()
    assert "seq_len 32" in markdown and ("(+" in markdown or "(-" in markdown)
    assert "seq_len 32" in result.stdout and "50" in result.stdout  # protocol caption, sparsity column


def test_eval_local_task(workspace, tmp_path):
    _, checkpoint, _, _ = workspace
    tasks = write_mc_task(tmp_path / "tasks")
    out = tmp_path / "zs.json"

    result = invoke_gmc("eval", checkpoint, "--tasks", "gmc_test_mc", "--include-path", tasks, "--limit", 4, "-o", out)

    assert result.exit_code == 0, result.output
    (model,) = json.loads(out.read_text())["models"]
    assert model["perplexity"] is None  # only --tasks given: no perplexity
    assert model["tasks"]["gmc_test_mc"]["metric"] == "acc"
    assert model["tasks"]["gmc_test_mc"]["samples"] == 4
    assert model["zero_shot_mean"] == model["tasks"]["gmc_test_mc"]["value"]


def test_tasks_paper_expands_to_the_six_paper_tasks():
    from gmc.runtime.evaluate import PAPER_TASKS, ZeroShotConfig

    assert ZeroShotConfig("paper").tasks == PAPER_TASKS
    assert ZeroShotConfig("arc_easy, piqa").tasks == ("arc_easy", "piqa")
    assert ZeroShotConfig(limit="200").limit == 200 and ZeroShotConfig(limit="0.5").limit == 0.5
