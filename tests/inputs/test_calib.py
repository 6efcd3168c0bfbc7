import json

import pytest
import torch
from conftest import CharTokenizer, tiny_model

from gmc.errors import GmcError
from gmc.inputs.calib import load_texts, self_generated_blocks, token_blocks
from gmc.inputs.model import LoadedModel


def test_local_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first line\n\n  \nsecond line\n")
    assert load_texts(str(tmp_path / "a.txt"))[0] == ["first line", "second line"]
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    assert load_texts(str(tmp_path / "b.jsonl"))[0] == ["one", "two"]
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(GmcError, match=r"c.jsonl:1 has no string field 'text'"):
        load_texts(str(tmp_path / "c.jsonl"))


def test_unknown_source_lists_what_is_allowed():
    with pytest.raises(GmcError, match="unknown text source 'wikitxt'.*wikitext2"):
        load_texts("wikitxt")


def test_blocks_are_packed_with_bos_and_shuffled_by_seed():
    tokenizer = CharTokenizer()
    lines = ["abc", "defgh", "ij"] * 10
    blocks = token_blocks(tokenizer, lines, seq_len=8, nsamples=None, seed=0)
    stream = []
    for line in lines:
        stream += tokenizer(line)["input_ids"]  # BOS + bytes
    assert blocks.shape == (len(stream) // 8, 8)
    assert sorted(map(tuple, blocks.tolist())) == sorted(
        tuple(stream[i:i + 8]) for i in range(0, len(stream) // 8 * 8, 8))
    assert torch.equal(blocks, token_blocks(tokenizer, lines, 8, None, seed=0))
    assert not torch.equal(blocks, token_blocks(tokenizer, lines, 8, None, seed=1))
    with pytest.raises(GmcError, match="text too short"):
        token_blocks(tokenizer, ["a"], 64, None, 0)


def test_self_calibration_samples_from_the_model_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("GMC_CACHE", str(tmp_path))
    loaded = LoadedModel(tiny_model("llama"), CharTokenizer(), "tiny")
    blocks = self_generated_blocks(loaded, nsamples=3, seq_len=12, seed=5)
    assert blocks.shape == (3, 12) and (blocks[:, 0] == CharTokenizer.bos_token_id).all()
    assert len(set(map(tuple, blocks.tolist()))) == 3  # sampled, not greedy copies
    cached = list((tmp_path / "self").iterdir())
    assert len(cached) == 1
    assert torch.equal(self_generated_blocks(loaded, 3, 12, 5), blocks)
