"""``gmc.runtime.bench`` on a tiny HF directory, its masks artifact and their lowered directory: a record per
ref x thread count x test with positive t/s, repetitions interleaved across refs after the warm-up, each on
its thread count (torch's restored), the three renderings, the refusals, and what ``-o`` may replace."""
import csv
import io
import json

import pytest
import torch
from conftest import save_random_artifact, tiny_model

import gmc.runtime.bench as bench
from gmc.errors import GmcError
from gmc.runtime.bench import FIELDS, BenchConfig, check_bench_path, parse_threads, render, run_bench, write_bench
from gmc.runtime.host import copy_bandwidth_gbs


@pytest.fixture(scope="module")
def refs(tiny_model_dir, tmp_path_factory):
    """``[model dir, masks artifact, lowered dir]``: 1x16 masks keeping half the groups of ``tiny_model_dir``."""
    from gmc.lower.stage import LowerConfig, lower_artifact

    root = tmp_path_factory.mktemp("bench")
    model = tiny_model("llama", hidden_size=128, intermediate_size=320)  # the model saved in tiny_model_dir
    artifact = save_random_artifact(root / "masks", str(tiny_model_dir), model, keep=0.5)
    lower_artifact(LowerConfig(artifact=str(artifact), output=str(root / "lowered"), progress=False))
    return [str(tiny_model_dir), str(artifact), str(root / "lowered")]


@pytest.fixture(scope="module")
def records(refs):
    return run_bench(BenchConfig(refs, n_prompt=8, n_gen=4, repetitions=2, threads="1"))


def test_every_ref_and_test_has_a_positive_rate_and_its_form(refs, records):
    assert [(r["ref"], r["test"]) for r in records] == [(ref, test) for ref in refs for test in ("pp8", "tg4")]
    for record in records:
        assert record["tokens_per_s"] > 0 and len(record["samples_tokens_per_s"]) == 2
        assert record["tokens_per_s"] == pytest.approx(sum(record["samples_tokens_per_s"]) / 2)
        assert record["threads"] == 1 and record["host"]["copy_gbs"]["1"] > 0
    forms = {r["ref"]: r["form"] for r in records}
    assert list(forms.values()) == ["eager dense", "eager masks", "eager lowered"]
    sizes = {r["ref"]: r["size_mib"] for r in records}
    assert sizes[refs[2]] < sizes[refs[1]] == sizes[refs[0]]  # packed: half the target groups


def test_repetitions_interleave_across_refs_after_the_warmup_on_each_thread_count(refs, monkeypatch):
    calls = []

    def fake(name):
        return lambda subject, *_: calls.append((name, subject.ref, torch.get_num_threads())) or 100.0

    monkeypatch.setattr(bench, "_pp", fake("pp"))
    monkeypatch.setattr(bench, "_tg", fake("tg"))
    before = torch.get_num_threads()
    out = run_bench(BenchConfig(refs[:2], n_prompt=8, n_gen=4, repetitions=2, warmup=1, threads="2,1"))
    a, b = refs[:2]
    per_threads = [(test, ref) for test in ("pp", "tg") for ref in (a, b) * 3]  # warm-up, rep 1, rep 2
    assert calls == [(test, ref, threads) for threads in (2, 1) for test, ref in per_threads]
    assert torch.get_num_threads() == before
    assert [(r["ref"], r["threads"], r["test"]) for r in out] == [
        (ref, threads, test) for ref in (a, b) for threads in (2, 1) for test in ("pp8", "tg4")]
    assert all(r["tokens_per_s"] == 100.0 and r["tokens_per_s_std"] == 0.0 for r in out)


def test_markdown_is_a_llama_bench_table_with_the_host(records):
    lines = render(records, "md").splitlines()
    assert [cell.strip() for cell in lines[0].strip("|").split("|")] == \
        ["model", "form", "size (MiB)", "threads", "test", "t/s"]
    rows = lines[2:2 + len(records)]
    assert all(" ± " in row and row.startswith("| ") for row in rows)
    assert lines[2 + len(records)] == ""
    assert lines[-2].startswith("host: ") and "GB/s on 1 thread" in lines[-2]
    assert lines[-1].startswith("gmc bench ") and "2 repetitions after 1 warm-up" in lines[-1]


def test_json_round_trips_and_csv_has_every_field(records):
    assert json.loads(render(records, "json")) == records
    rows = list(csv.DictReader(io.StringIO(render(records, "csv"))))
    assert len(rows) == len(records) and set(FIELDS) <= set(rows[0]) and "host_cpu" in rows[0]
    assert [float(row["tokens_per_s"]) for row in rows] == [r["tokens_per_s"] for r in records]


@pytest.mark.parametrize("kwargs, message", [
    ({"n_prompt": 0}, "bad -p/--n-prompt 0"),
    ({"n_gen": 0}, "bad -n/--n-gen 0"),
    ({"repetitions": 0}, "bad -r/--repetitions 0"),
    ({"warmup": -1}, "bad --warmup -1"),
    ({"format": "xml"}, "bad --format 'xml': expected one of md, json, csv"),
    ({"threads": "1,,2"}, "bad -t/--threads '1,,2': expected comma-separated positive integers"),
    ({"threads": "0"}, "bad -t/--threads '0'"),
    ({"threads": "two"}, "bad -t/--threads 'two'"),
])
def test_config_refuses_bad_values(refs, kwargs, message):
    with pytest.raises(GmcError, match=message):
        BenchConfig(refs[:1], **kwargs)


def test_unknown_refs_are_refused_before_loading(tmp_path):
    with pytest.raises(GmcError, match="model or artifact not found: ./missing-model"):
        BenchConfig(("./missing-model",))
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "genai_config.json").write_text("{}")
    with pytest.raises(GmcError, match="genai_config.json is not a valid onnxruntime-genai config"):
        BenchConfig((str(tmp_path / "onnx"),))


def test_threads_default_to_torch_and_parse_from_text():
    assert parse_threads(None) == (torch.get_num_threads(),)
    assert parse_threads("1, 2,4") == (1, 2, 4) and parse_threads([2]) == (2,)


@pytest.mark.parametrize("format", ["md", "json", "csv"])
def test_output_replaces_only_bench_results_with_overwrite(records, tmp_path, format):
    path = tmp_path / f"bench.{format}"
    write_bench(path, render(records, format))
    with pytest.raises(GmcError, match="pass --overwrite"):
        check_bench_path(path)
    assert write_bench(path, render(records[:1], format), overwrite=True) == path
    foreign = tmp_path / f"notes.{format}"
    foreign.write_text("| model | mine |\n")
    with pytest.raises(GmcError, match="a file that gmc did not write"):
        check_bench_path(foreign, overwrite=True)


def test_output_may_not_be_an_input(refs):
    with pytest.raises(GmcError, match="would replace"):
        BenchConfig(refs[:1], output=refs[0])


def test_copy_bandwidth_restores_the_thread_count():
    before = torch.get_num_threads()
    assert copy_bandwidth_gbs(2, repeats=2, mib=8) > 0
    assert torch.get_num_threads() == before
