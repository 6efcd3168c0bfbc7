"""What gmc loads and runs: no model repository's code without --trust-remote-code."""
import pytest
from click.testing import CliRunner


def test_models_load_with_trust_remote_code_false_unless_asked(tiny_model_dir, monkeypatch):
    import transformers

    from gmc.inputs.model import load_model

    seen = []
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        real = cls.from_pretrained

        def recording(*args, _real=real, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", recording)
    load_model(str(tiny_model_dir))
    assert seen == [False, False]
    seen.clear()
    load_model(str(tiny_model_dir), trust_remote_code=True)
    assert seen == [True, True]


def test_auto_map_code_of_a_model_directory_is_not_run(tiny_model_dir, tmp_path):
    import json
    import shutil

    from gmc.inputs.model import load_model

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    marker = tmp_path / "code-ran"
    (model_dir / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model_dir / "config.json").write_text(json.dumps(config))
    try:
        load_model(str(model_dir))  # the built-in Llama class, or a refusal naming --trust-remote-code
    except Exception as error:
        assert "--trust-remote-code" in str(error)
    assert not marker.exists()


@pytest.mark.parametrize("command", ["prune", "eval", "lower", "reconstruct"])
def test_commands_that_load_models_offer_trust_remote_code_and_overwrite(command):
    from gmc.cli.main import cli

    text = CliRunner().invoke(cli, [command, "--help"]).output
    assert "--trust-remote-code" in text and "--overwrite" in text
