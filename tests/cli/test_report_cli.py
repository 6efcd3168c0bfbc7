"""``gmc report`` on a hand-made manifest: the outputs and the table, one-line errors."""
import json

from conftest import correlated, invoke_gmc, write_manifest


def test_report_writes_outputs_and_prints_the_table(tmp_path):
    artifact = write_manifest(tmp_path / "a", correlated)
    result = invoke_gmc("report", artifact, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "Pearson r, Q vs K across layers: 1.000" in result.stdout
    assert "share of preserved" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".gmc-output", "attention_vs_mlp.png", "rates_by_layer.png", "report.json", "report.md"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["layers"] == [0, 1, 2, 3]


def test_report_bad_artifact_is_one_line(tmp_path):
    result = invoke_gmc("report", tmp_path / "missing")
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("gmc: error: not a masks artifact")
