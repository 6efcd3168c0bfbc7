"""bench/fidelity.py on a tiny random model: rows run, results.md is written with its command line,
cached rows are skipped on a re-run, and a changed setting re-runs only the rows it affects."""
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import CharTokenizer, tiny_model
from gmc.model import LoadedModel

BENCH = Path(__file__).resolve().parent.parent / "bench" / "fidelity.py"


@pytest.fixture(scope="module")
def fidelity():
    spec = importlib.util.spec_from_file_location("fidelity", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fidelity"] = module  # dataclasses resolve string annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("fidelity", None)


def _settings(fidelity, **overrides):
    settings = fidelity.Settings("quick", steps=3, seq_len=32, nsamples=8, heuristic_nsamples=4, eval_seq_len=256,
                                 zero_shot_limit=0)
    return replace(settings, **overrides)


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, much faster on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_rows_markdown_and_cache(fidelity, tmp_path, monkeypatch, one_thread):
    loaded = LoadedModel(tiny_model("llama", hidden_size=128, intermediate_size=320), CharTokenizer(), "tiny")
    keys = ["dense", "gm", "magnitude-uniform"]
    out, md, plots = tmp_path / "out", tmp_path / "docs" / "results.md", tmp_path / "docs" / "results"
    messages = []
    results = fidelity.run_rows(loaded, keys, _settings(fidelity), out, log=messages.append)

    assert list(results) == keys
    assert results["dense"]["global_sparsity"] == 0.0
    for key in ("gm", "magnitude-uniform"):
        assert abs(results[key]["global_sparsity"] - 0.5) <= 0.01
        assert results[key]["ppl"] > results["dense"]["ppl"] * 0.5  # a number, not garbage
    gm = results["gm"]
    assert gm["steps"] == 3 and gm["train_seq_len"] == 32 and gm["trainable_params"] > 0
    assert gm["tokens_scored"] > 0 and gm["eval_seq_len"] == 256 and "bundled-heldout" in gm["eval_text"]
    assert not (out / "artifacts" / "gm" / "hypernetwork.pt").exists()  # dropped: can be GBs
    assert sorted(p.name for p in (out / "rows").iterdir()) == ["dense.json", "gm.json", "magnitude-uniform.json"]
    cached = json.loads((out / "rows" / "gm.json").read_text())
    assert cached["spec"]["steps"] == 3 and cached["result"]["ppl"] == gm["ppl"]

    command = "python bench/fidelity.py --quick --rows dense gm magnitude-uniform"
    text = fidelity.write_results(results, _settings(fidelity), command, out, md, plots, "now", 1.0)
    assert md.read_text() == text
    assert f"Command: `{command}`" in text.splitlines()[2]
    assert "QUICK run" in text.splitlines()[0] and "produced by `--quick`" in text
    assert "## Disagreements with the paper" in text and "## Findings: paper vs gmc" in text
    assert (plots / "gm_rates_by_layer.png").is_file() and "](results/gm_rates_by_layer.png)" in text

    # re-run: every row comes from the cache; nothing is pruned or evaluated
    def refuse(*_, **__):
        raise AssertionError("a cached row was run again")

    monkeypatch.setattr(fidelity, "prune", refuse)
    monkeypatch.setattr(fidelity, "perplexity", refuse)
    messages.clear()
    again = fidelity.run_rows(loaded, keys, _settings(fidelity), out, log=messages.append)
    assert again == results
    assert all("cached" in message for message in messages)

    # more training steps invalidate the learned row only
    monkeypatch.undo()
    messages.clear()
    changed = fidelity.run_rows(loaded, keys, _settings(fidelity, steps=4), out, log=messages.append)
    assert changed["gm"]["steps"] == 4
    assert [m.split(":")[0] for m in messages if "running" in m] == ["[fidelity] gm"]
    assert changed["dense"] == results["dense"] and changed["magnitude-uniform"] == results["magnitude-uniform"]


def _row(method, ppl, *, target=0.5, trained=None, moved=None):
    return {"method": method, "ppl": ppl, "target_sparsity": target, "global_sparsity": target,
            "final_train_sparsity": trained, "threshold_moved": moved}


def test_findings_flag_learned_rows_that_missed_the_budget(fidelity):
    """Finding 1 rests on gm and gm-uniform: a row far short of its budget makes the verdict
    inconclusive; one a little short keeps its verdict with a caveat naming how far it got."""
    results = {"gm": _row("groupmask", 100.0, trained=0.50, moved=False),
               "gm-uniform": _row("groupmask", 300.0, trained=0.45, moved=True)}
    finding = {f.number: f for f in fidelity.findings(results)}["1"]
    assert finding.verdict == "agrees"
    assert finding.shown == "agrees (caveat: training reached only gm-uniform 45% of 50%; the export threshold " \
                            "chose the rest)"

    results["gm-uniform"] = _row("groupmask", 300.0, trained=0.10, moved=True)
    verdict = {f.number: f.verdict for f in fidelity.findings(results)}["1"]
    assert verdict.startswith("inconclusive") and "gm-uniform pruned 10%" in verdict

    results["gm-uniform"] = _row("groupmask", 300.0, trained=0.50, moved=False)
    finding = {f.number: f for f in fidelity.findings(results)}["1"]
    assert finding.verdict == "agrees" and finding.caveat == "" and finding.shown == "agrees"
