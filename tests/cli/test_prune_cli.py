"""``gmc prune`` end to end through the CLI: artifacts, dense checkpoints, one-line errors.

The one-shot runs whose process-level output is part of the point (one-line errors, the one-line
warning, the summary table, --version, --help) run as processes of their own, all forked from one
interpreter start (``run_gmc_cases``, module fixtures); runs checked only by what they write, and
runs that need the files of an earlier one, run in process (one-line checks as a user's process)."""
import json
import os

import pytest
import torch
from conftest import byte_bpe_tokenizer, invoke_gmc, run_gmc, run_gmc_cases, tiny_model
from transformers import AutoModelForCausalLM

from gmc.formats.artifact import load_artifact


@pytest.mark.slow
def test_wanda_prune_writes_artifact_and_loadable_dense_checkpoint(tiny_model_dir, one_shot):
    result, out = one_shot["wanda"]
    dense = out.parent / "wanda-hf"
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["method"] == "wanda" and manifest["group"] == "1x64"
    assert abs(manifest["global_sparsity"] - 0.5) <= 0.005
    assert "q_proj" in result.stderr  # the per-layer summary table

    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    load_artifact(out).apply_to(original)
    reloaded = AutoModelForCausalLM.from_pretrained(dense)  # plain transformers
    ids = torch.randint(0, 300, (1, 12))
    torch.testing.assert_close(reloaded(ids).logits, original(ids).logits, atol=1e-5, rtol=0)
    assert (dense / "tokenizer.json").is_file()


BAD_OPTIONS = [
    (["--group", "0x256"], "bad group '0x256'"),
    (["--group", "banana"], "bad group 'banana'"),
    (["--sparsity", "1.5"], "bad --sparsity 1.5"),
    (["--sparsity", "0"], "bad --sparsity 0"),
    (["--group", "2:4", "--method", "groupmask"], "N:M pattern"),
    (["--method", "magnitude", "--allocation", "adaptive"], "--allocation 'adaptive' does not go with"),
    (["--calib", "/nonexistent/text.txt", "--method", "wanda"], "text file not found"),
]

UNKNOWN_MODELS = [
    ("/nonexistent/dir", "unknown model"),
    ("no-such-org/no-such-model", "cannot load hub model"),
    ("missing.gguf", "GGUF file not found"),
]


@pytest.fixture(scope="module")
def one_shot(tiny_model_dir, tmp_path_factory):
    """``{case: (result, output path)}``: a wanda run with its dense checkpoint (``wanda-hf`` beside its
    output), each bad option of ``BAD_OPTIONS`` (keyed ``("bad", *args)``, writing to a fresh directory's
    ``x``), a too-short training run, ``--version`` and ``prune --help``, each a ``gmc`` process of its
    own (``run_gmc_cases``)."""
    wanda = tmp_path_factory.mktemp("wanda")
    runs = {"wanda": ("prune", tiny_model_dir, "--method", "wanda", "--group", "1x64", "--calib", "bundled",
                      "--seq-len", "32", "--nsamples", "4", "-o", wanda / "wanda", "--save-dense", wanda / "wanda-hf")}
    runs.update({("bad", *args): ("prune", tiny_model_dir, "-o", tmp_path_factory.mktemp("bad") / "x", *args)
                 for args, _ in BAD_OPTIONS})
    runs["too short"] = ("prune", tiny_model_dir, "--group", "1x64", "--calib", "bundled", "--seq-len", "16",
                         "--nsamples", "2", "--steps", "1", "--budget", "penalty", "--quiet",
                         "-o", tmp_path_factory.mktemp("short") / "gm")
    runs["version"] = ("--version",)
    runs["help"] = ("prune", "--help")
    results = run_gmc_cases(list(runs.values()))
    return {name: (result, args[args.index("-o") + 1] if "-o" in args else None)
            for (name, args), result in zip(runs.items(), results)}


@pytest.fixture(scope="module")
def unknown_models(tmp_path_factory):
    """``{model: result}`` of ``gmc prune MODEL`` offline for each of ``UNKNOWN_MODELS``, each a process of its
    own run from one scratch directory (``missing.gguf`` is relative to it)."""
    cwd = tmp_path_factory.mktemp("unknown")
    results = run_gmc_cases([("prune", model, "--method", "magnitude", "-o", cwd / f"x{i}")
                             for i, (model, _) in enumerate(UNKNOWN_MODELS)],
                            cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return {model: result for (model, _), result in zip(UNKNOWN_MODELS, results)}


@pytest.mark.slow
def test_too_short_training_warns_in_one_line(one_shot):
    result, _ = one_shot["too short"]
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and warning[0].startswith("gmc: warning: training ended at 0.0% sparsity"), warning
    assert "Traceback" not in result.stderr and "warnings.warn" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", BAD_OPTIONS)
def test_bad_options_are_one_line_exit_2(one_shot, args, expected):
    result, out = one_shot[("bad", *args)]
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gmc: error:") and expected in lines[0], result.stderr
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("model, expected", UNKNOWN_MODELS)
def test_unknown_model_is_one_line_exit_2(unknown_models, model, expected):
    result = unknown_models[model]
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


@pytest.mark.slow
def test_offline_hub_dataset_suggests_local_path(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    result = run_gmc("prune", tiny_model_dir, "--method", "wanda", "--calib", "wikitext2", "-o", tmp_path / "x")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot load hub dataset 'wikitext2'" in lines[0] and "local" in lines[0]


@pytest.mark.slow
def test_version_and_help(one_shot):
    assert one_shot["version"][0].stdout.startswith("gmc, version")
    help_text = one_shot["help"][0].stdout
    for option in ("--group", "--sparsity", "--method", "--allocation", "--calib", "--resume", "--save-dense"):
        assert option in help_text


@pytest.mark.slow
def test_masks_that_do_not_match_and_corrupted_artifacts_are_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "mag"
    assert invoke_gmc("prune", tiny_model_dir, "--method", "magnitude", "--group", "1x64", "-o", out).exit_code == 0
    other = tmp_path / "other"  # same architecture, other weights
    tiny_model("llama", seed=1, hidden_size=128, intermediate_size=320).save_pretrained(other)
    byte_bpe_tokenizer().save_pretrained(other)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "model": str(other)}))
    result = invoke_gmc("eval", out, "--ppl", "bundled-heldout", "--seq-len", "16")
    assert result.exit_code == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gmc: error: masks do not match the model") and "fingerprint" in last

    (out / "masks.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken")
    result = run_gmc("eval", out, "--ppl", "bundled-heldout", "--seq-len", "16")  # the one line: as a user's process
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "corrupted artifact" in lines[0]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:training ended at:RuntimeWarning")  # 2 steps of the paper's penalty
def test_recipe_paper_sets_the_papers_training_and_explicit_options_win(tiny_model_dir, tmp_path):
    common = ("prune", tiny_model_dir, "--group", "1x64", "--calib", "bundled", "--seq-len", "16", "--nsamples", "2",
              "--quiet")
    default = invoke_gmc(*common, "--steps", "2", "-o", tmp_path / "default")
    paper = invoke_gmc(*common, "--recipe", "paper", "--steps", "2", "--lr", "5e-3", "-o", tmp_path / "paper")
    assert default.exit_code == 0 and paper.exit_code == 0, default.output + paper.output
    ours = json.loads((tmp_path / "default" / "manifest.json").read_text())["training"]
    theirs = json.loads((tmp_path / "paper" / "manifest.json").read_text())["training"]
    assert (ours["budget"], ours["lam"], ours["init"], ours["offset"]) == ("schedule", 64.0, "none", 4.0)
    assert (theirs["budget"], theirs["lam"], theirs["init"], theirs["offset"]) == ("penalty", 16.0, "none", 3.0)
    assert theirs["steps"] == 2 and theirs["lr"] == 5e-3  # given on the command line: not the recipe's


def test_prune_with_recovery_steps_writes_tuned_weights(tiny_model_dir, tmp_path):
    out = tmp_path / "gm"
    result = invoke_gmc("prune", tiny_model_dir, "--group", "1x64", "--calib", "bundled", "--seq-len", "16",
                        "--nsamples", "4", "--steps", "4", "--init", "wanda", "--recover-steps", "3", "--quiet",
                        "-o", out)
    assert result.exit_code == 0, result.output
    artifact = load_artifact(out)
    assert artifact.manifest["weights_updated"] is True and artifact.manifest["recovery"]["steps"] == 3
    assert artifact.manifest["training"]["init"] == "wanda"
    for name, selectors in artifact.masks.items():
        keep = artifact.pattern.expand(selectors, tuple(artifact.weights[name].shape))
        assert torch.all(artifact.weights[name][~keep] == 0)
    assert (out / "recover_log.jsonl").is_file()
    assert not (tmp_path / "gm.recover-ckpt").exists() and not (tmp_path / "gm.ckpt").exists()


def test_prune_sparsegpt_2_4_via_cli(magnitude_workspace, tmp_path):
    model_dir, _, calib = magnitude_workspace
    out = tmp_path / "sgpt"
    result = invoke_gmc("prune", model_dir, "--method", "sparsegpt", "--group", "2:4", "--calib", calib,
                        "--nsamples", 4, "--seq-len", 32, "-o", out, "--quiet")
    assert result.exit_code == 0, result.output
    artifact = load_artifact(out)
    assert artifact.manifest["weights_updated"] is True and artifact.manifest["method"] == "sparsegpt"
    assert len(artifact.weights) == len(artifact.masks) == 14
    for name, keep in artifact.masks.items():
        assert torch.all(keep.reshape(keep.shape[0], -1, 4).sum(-1) == 2)
        assert torch.all(artifact.weights[name][~keep] == 0)


def test_a_recipe_for_a_one_shot_method_is_refused_in_one_line(tmp_path):
    result = invoke_gmc("prune", "smollm2-135m", "--method", "wanda", "--recipe", "paper", "-o", tmp_path / "x")
    assert result.exit_code == 2
    assert result.output.strip() == ("gmc: error: --recipe paper sets learning options: it applies to --method "
                                     "groupmask or direct, not wanda")
    assert not (tmp_path / "x").exists()


def test_prune_prints_its_summary_as_json(tiny_model_dir, tmp_path):
    result = invoke_gmc("prune", tiny_model_dir, "--method", "magnitude", "--group", "1x64", "--json",
                        "-o", tmp_path / "mag")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["output"] == str(tmp_path / "mag") and summary["method"] == "magnitude"
    assert abs(summary["global_sparsity"] - 0.5) < 0.05 and summary["layer_sparsity"]
