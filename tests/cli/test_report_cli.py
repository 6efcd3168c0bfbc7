import json

from click.testing import CliRunner

from gmc.cli.main import _register_commands, cli
from evalkit import correlated, write_manifest

_register_commands()


def test_report_writes_outputs_and_prints_the_table(tmp_path):
    artifact = write_manifest(tmp_path / "a", correlated)
    result = CliRunner().invoke(cli, ["report", str(artifact), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "Pearson r, Q vs K across layers: 1.000" in result.stdout
    assert "share of preserved" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".gmc-output", "attention_vs_mlp.png", "rates_by_layer.png", "report.json", "report.md"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["layers"] == [0, 1, 2, 3]


def test_report_bad_artifact_is_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "missing")])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("gmc: error: not a masks artifact")
