"""``gmc bench`` on a tiny HF directory, its masks artifact and their lowered directory in each format,
``-o`` and its refusals, one-line errors; the slow test adds a compiled lowered directory and an ONNX file."""
import csv
import io
import json

import pytest
from conftest import invoke_gmc, save_random_artifact, tiny_model

QUICK = ("-p", "8", "-n", "4", "-r", "2", "-t", "1")


@pytest.fixture(scope="module")
def refs(tiny_model_dir, tmp_path_factory):
    """``[model dir, masks artifact, lowered dir]`` over ``tiny_model_dir``."""
    from gmc.lower.stage import LowerConfig, lower_artifact

    root = tmp_path_factory.mktemp("bench-cli")
    model = tiny_model("llama", hidden_size=128, intermediate_size=320)  # the model saved in tiny_model_dir
    artifact = save_random_artifact(root / "masks", str(tiny_model_dir), model, keep=0.5)
    lower_artifact(LowerConfig(artifact=str(artifact), output=str(root / "lowered"), progress=False))
    return [str(tiny_model_dir), str(artifact), str(root / "lowered")]


def _ok(result) -> str:
    assert result.exit_code == 0, result.output
    return result.stdout


def test_markdown_table_has_a_positive_rate_per_ref_and_test(refs):
    lines = _ok(invoke_gmc("bench", *refs, *QUICK)).splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:8]]
    assert [(row[0], row[4]) for row in rows] == [(ref, test) for ref in refs for test in ("pp8", "tg4")]
    assert [row[1] for row in rows[::2]] == ["eager dense", "eager masks", "eager lowered"]
    assert all(float(row[5].split(" ± ")[0]) > 0 for row in rows)
    assert lines[-2].startswith("host: ") and lines[-1].startswith("gmc bench ")


def test_json_records_round_trip(refs):
    records = json.loads(_ok(invoke_gmc("bench", *refs, *QUICK, "--format", "json")))
    assert len(records) == 6 and all(r["tokens_per_s"] > 0 and r["repetitions"] == 2 for r in records)
    assert {r["test"] for r in records} == {"pp8", "tg4"} and records[0]["host"]["cores"] >= 1


@pytest.mark.slow
def test_csv_has_the_header_and_a_row_per_record(refs):
    rows = list(csv.reader(io.StringIO(_ok(invoke_gmc("bench", *refs, *QUICK, "--format", "csv")))))
    header = rows[0]
    assert header[:3] == ["ref", "form", "size_mib"] and "tokens_per_s" in header and "host_cpu" in header
    assert len(rows) == 7 and all(float(row[header.index("tokens_per_s")]) > 0 for row in rows[1:])


def test_output_file_is_written_and_replaced_only_with_overwrite(refs, tmp_path):
    out = tmp_path / "bench.json"
    args = ("bench", refs[2], "-p", "4", "-n", "2", "-r", "1", "-t", "1", "--format", "json", "-o", out)
    result = invoke_gmc(*args)
    assert _ok(result) == "" and f"wrote {out}" in result.stderr
    assert [r["test"] for r in json.loads(out.read_text())] == ["pp4", "tg2"]
    again = invoke_gmc(*args)
    assert again.exit_code == 2 and "pass --overwrite" in again.output
    _ok(invoke_gmc(*args, "--overwrite"))


@pytest.mark.parametrize("args, message", [
    (("-p", "0"), "bad -p/--n-prompt 0"),
    (("-n", "0"), "bad -n/--n-gen 0"),
    (("-r", "0"), "bad -r/--repetitions 0"),
    (("-t", "1,a"), "bad -t/--threads '1,a'"),
    (("-t", "0"), "bad -t/--threads '0'"),
    (("--format", "xml"), "'xml' is not one of 'md', 'json', 'csv'"),
])
def test_bad_options_are_one_line_errors(refs, args, message):
    result = invoke_gmc("bench", refs[0], *args)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [result.output.strip()] and message in result.output
    assert result.output.startswith("gmc: error: ")


def test_unknown_ref_and_foreign_output_are_one_line_errors(refs, tmp_path):
    missing = invoke_gmc("bench", refs[0], "./no-such-model")
    assert missing.exit_code == 2 and missing.output.strip() == "gmc: error: model or artifact not found: " \
                                                                "./no-such-model (no such directory)"
    notes = tmp_path / "notes.md"
    notes.write_text("mine\n")
    foreign = invoke_gmc("bench", refs[0], "-o", notes, "--overwrite")
    assert foreign.exit_code == 2 and "a file that gmc did not write" in foreign.output
    assert notes.read_text() == "mine\n"


@pytest.mark.slow
def test_compiled_packages(refs, tmp_path):
    """A ``gmc lower --compile`` directory runs its compiled programs (ONNX directories:
    tests/lower/test_onnx_backend.py)."""
    compiled = tmp_path / "compiled"
    _ok(invoke_gmc("lower", refs[1], "--compile", "--max-len", "16", "--quiet", "-o", compiled))
    records = json.loads(_ok(invoke_gmc("bench", compiled, *QUICK, "--format", "json")))
    assert [(r["form"], r["test"]) for r in records] == [
        ("compiled lowered (AOTInductor, cpu)", "pp8"), ("compiled lowered (AOTInductor, cpu)", "tg4")]
    assert all(r["tokens_per_s"] > 0 and r["size_mib"] > 0 for r in records)
    too_long = invoke_gmc("bench", compiled, "-p", "16", "-n", "4", "-r", "1", "-t", "1")
    assert too_long.exit_code == 2 and "hold 16 positions and -p/-n need 17" in too_long.output
