import math

import pytest
import torch
from conftest import (
    CharTokenizer,
    save_random_artifact,
    save_tiny_smol,
    smol_tokenizer,
    tiny_model,
    tiny_smol_model,
    write_mc_task,
    write_text,
)

from gmc.errors import GmcError
from gmc.runtime.evaluate import (
    EvalConfig,
    PerplexityConfig,
    ZeroShotConfig,
    evaluate_refs,
    load_document,
    perplexity,
    perplexity_windows,
    zero_shot,
)
from gmc.runtime.results import results_markdown, write_results


@pytest.fixture
def text_file(tmp_path):
    return write_text(tmp_path / "text.txt", paragraphs=12)  # about 800 tokens


def hand_token_nlls(model, window: torch.Tensor) -> torch.Tensor:
    """NLL of tokens 1..L-1 of one window, one position at a time: ``[L-1]``."""
    with torch.no_grad():
        logits = model(window[None]).logits[0].double()  # [L, V]
    logp = torch.log_softmax(logits, dim=-1)
    return torch.stack([-logp[j, window[j + 1]] for j in range(len(window) - 1)])


def test_perplexity_equals_hand_computation(text_file):
    model, tokenizer, seq_len = tiny_model("llama"), CharTokenizer(), 64
    ids = torch.tensor(tokenizer(load_document(str(text_file))[0])["input_ids"])
    windows = len(ids) // seq_len
    nll = torch.cat([hand_token_nlls(model, ids[i * seq_len:(i + 1) * seq_len]) for i in range(windows)])

    result = perplexity(model, tokenizer, str(text_file), seq_len=seq_len, progress=False)

    assert result.protocol["windows"] == windows
    assert result.protocol["tokens"] == len(ids)
    assert result.protocol["tokens_scored"] == windows * (seq_len - 1) == len(nll)
    assert result.protocol["seq_len"] == seq_len and result.protocol["stride"] is None
    assert result.perplexity == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)


def test_sliding_stride_scores_every_token_once_with_context(text_file):
    model, tokenizer, seq_len, stride = tiny_model("llama"), CharTokenizer(), 64, 40
    ids = torch.tensor(tokenizer(load_document(str(text_file))[0])["input_ids"])
    nll, scored_until, end = [], 0, seq_len
    while True:  # windows of seq_len ending stride apart, the last one at the end of the text
        end = min(end, len(ids))
        begin = end - seq_len
        token_nll = hand_token_nlls(model, ids[begin:end])  # entry j scores position begin + j + 1
        first = max(scored_until, begin + 1)
        nll.append(token_nll[first - begin - 1:])
        scored_until = end
        if end == len(ids):
            break
        end += stride
    nll = torch.cat(nll)

    result = perplexity(model, tokenizer, str(text_file), seq_len=seq_len, stride=stride, progress=False)

    assert len(nll) == len(ids) - 1 == result.protocol["tokens_scored"]
    assert result.protocol["windows"] == 1 + math.ceil((len(ids) - seq_len) / stride)
    assert result.perplexity == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)


def test_batch_size_does_not_change_perplexity(text_file):
    model, tokenizer = tiny_model("llama"), CharTokenizer()
    one = perplexity(model, tokenizer, str(text_file), seq_len=32, progress=False)
    three = perplexity(model, tokenizer, str(text_file), seq_len=32, batch_size=3, progress=False)
    assert three.perplexity == pytest.approx(one.perplexity, rel=1e-5)
    assert three.protocol == one.protocol


@pytest.mark.parametrize("n, seq_len, stride, expected", [
    (10, 4, None, [(0, 1), (4, 5)]),
    (8, 4, None, [(0, 1), (4, 5)]),
    (3, 4, None, []),
    (10, 4, 2, [(0, 1), (2, 4), (4, 6), (6, 8)]),
    (9, 4, 4, [(0, 1), (4, 5), (5, 8)]),
    (4, 4, 1, [(0, 1)]),
])
def test_windows(n, seq_len, stride, expected):
    assert perplexity_windows(n, seq_len, stride) == expected


def test_short_text_is_a_clear_error(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("only a few words\n")
    with pytest.raises(GmcError, match=r"too short.*tokens.*--seq-len 2048"):
        perplexity(tiny_model("llama"), CharTokenizer(), str(path), progress=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=1), "--seq-len"),
    (dict(stride=0), "--stride"),
    (dict(seq_len=8, stride=9), "at most --seq-len"),
    (dict(batch_size=0), "--batch-size"),
    (dict(source="nope"), "unknown text source"),
    (dict(source="missing/file.txt"), "text file not found"),
    (dict(source="wikitext2", split="dev"), "no split 'dev'"),
])
def test_perplexity_config_errors(kwargs, match):
    with pytest.raises(GmcError, match=match):
        PerplexityConfig(**{"source": "bundled-heldout", **kwargs})


@pytest.mark.parametrize("kwargs, match", [
    (dict(tasks=()), "--tasks"),
    (dict(limit=0), "--limit"),
    (dict(limit=2.5), "--limit"),
    (dict(include_path="/no/such/dir"), "--include-path"),
])
def test_zero_shot_config_errors(kwargs, match):
    with pytest.raises(GmcError, match=match):
        ZeroShotConfig(**kwargs)


def test_limit_normalised():
    assert ZeroShotConfig(limit=200.0).limit == 200 and isinstance(ZeroShotConfig(limit=200.0).limit, int)
    assert ZeroShotConfig(limit=0.25).limit == 0.25


@pytest.mark.slow
def test_zero_shot_local_task_reports_the_metric_the_yaml_defines(tmp_path):
    tasks = write_mc_task(tmp_path / "tasks", metrics=("acc_norm", "acc"))
    scores = zero_shot(tiny_smol_model(), smol_tokenizer(), ["gmc_test_mc"], limit=6, include_path=str(tasks))
    score = scores["tasks"]["gmc_test_mc"]
    assert score["metric"] == "acc_norm"  # the first metric of the YAML's metric_list
    assert score["samples"] == 6
    assert score["value"] * 6 == pytest.approx(round(score["value"] * 6))  # a fraction of 6 docs
    assert scores["zero_shot_mean"] == score["value"]
    assert scores["protocol"]["limit"] == 6 and scores["protocol"]["harness"].startswith("lm-eval")


@pytest.mark.slow  # indexes all of lm-eval's task YAMLs: 15-30 s on 2 shared cores
def test_zero_shot_unknown_task(tmp_path):
    tasks = write_mc_task(tmp_path / "tasks")
    with pytest.raises(GmcError, match="unknown task 'no_such_task_xyz'"):
        zero_shot(tiny_smol_model(), smol_tokenizer(), ["no_such_task_xyz"], include_path=str(tasks))


@pytest.mark.slow
def test_evaluate_refs_dense_and_masks_share_one_base(tmp_path, text_file, monkeypatch):
    import gmc.inputs.model

    checkpoint = save_tiny_smol(tmp_path / "dense")
    dense_model = tiny_smol_model()
    sparse = save_random_artifact(tmp_path / "sparse", str(checkpoint), dense_model, keep=0.5)
    sparser = save_random_artifact(tmp_path / "sparser", str(checkpoint), dense_model, keep=0.25, seed=1)
    loads = []
    real_load = gmc.inputs.model.load_model
    monkeypatch.setattr(gmc.inputs.model, "load_model", lambda ref, **kw: loads.append(ref) or real_load(ref, **kw))
    config = EvalConfig(perplexity=PerplexityConfig(str(text_file), seq_len=32))

    entries = evaluate_refs([str(sparse), str(checkpoint), str(sparser)], config)

    assert loads == [str(checkpoint)]
    masked, dense, more_masked = entries
    alone = perplexity(tiny_smol_model(), smol_tokenizer(), str(text_file), seq_len=32, progress=False)
    assert dense["perplexity"] == pytest.approx(alone.perplexity, rel=1e-6)  # restored after masks
    assert masked["kind"] == "masks" and dense["kind"] == "dense"
    assert masked["model_info"]["global_sparsity"] == pytest.approx(masked["model_info"]["zero_fraction"], abs=0.01)
    assert more_masked["model_info"]["zero_fraction"] > masked["model_info"]["zero_fraction"] > 0.4
    assert len({e["model_fingerprint"] for e in entries}) == 3
    assert dense["protocol"]["perplexity"]["seq_len"] == 32

    out = write_results(tmp_path / "results.json", entries)
    markdown = (tmp_path / "results.md").read_text()
    assert markdown == results_markdown(entries)
    assert f"| {checkpoint} |" in markdown and "seq_len 32" in markdown
    assert '"models"' in out.read_text()


@pytest.mark.slow
def test_lowered_model_matches_its_masks_artifact(tmp_path, text_file):
    from gmc.lower.stage import LowerConfig, lower_artifact

    checkpoint = save_tiny_smol(tmp_path / "dense")
    artifact = save_random_artifact(tmp_path / "masks", str(checkpoint), tiny_smol_model(), keep=0.5)
    lower_artifact(LowerConfig(artifact=str(artifact), output=str(tmp_path / "lowered")))
    config = EvalConfig(perplexity=PerplexityConfig(str(text_file), seq_len=32))

    masked, lowered = evaluate_refs([str(artifact), str(tmp_path / "lowered")], config)

    assert lowered["kind"] == "lowered"
    assert lowered["model_info"]["global_sparsity"] == masked["model_info"]["global_sparsity"]
    assert lowered["perplexity"] == pytest.approx(masked["perplexity"], rel=1e-4)


@pytest.mark.slow
def test_zero_shot_local_task_on_bundled_smollm2(smollm2, tmp_path):
    tasks = write_mc_task(tmp_path / "tasks")
    scores = zero_shot(smollm2.model, smollm2.tokenizer, ["gmc_test_mc"], include_path=str(tasks))
    score = scores["tasks"]["gmc_test_mc"]
    assert score["metric"] == "acc" and score["samples"] == 8 and 0.0 <= score["value"] <= 1.0


@pytest.mark.slow
def test_perplexity_of_bundled_smollm2_on_heldout_text(smollm2, tmp_path):
    from gmc.inputs.calib import load_texts

    path = tmp_path / "heldout.txt"
    path.write_text("\n".join(load_texts("bundled-heldout")[0][:20]))
    result = perplexity(smollm2.model, smollm2.tokenizer, str(path), seq_len=256, progress=False)
    assert result.protocol["windows"] >= 2
    assert 5.0 < result.perplexity < 100.0  # a trained model on English prose; random would be ~49152
