"""``gmc generate`` on a tiny HF directory, a masks artifact and a ``gmc lower --compile`` output: text on
stdout, one speed line on stderr, one-line errors. One compile (module fixture) serves every test but
the one of ``--compile`` itself."""
import pytest
from conftest import invoke_gmc, save_random_artifact, tiny_model

PROMPT = "the model"


@pytest.fixture(scope="module")
def compiled_workspace(tiny_model_dir, tmp_path_factory):
    """``(artifact_dir, lowered_dir)``: 1x16 masks over ``tiny_model_dir`` and their lowered directory
    with compiled prefill/decode programs of 32 positions."""
    root = tmp_path_factory.mktemp("generate")
    model = tiny_model("llama", hidden_size=128, intermediate_size=320)  # the model saved in tiny_model_dir
    artifact = save_random_artifact(root / "masks", str(tiny_model_dir), model, keep=0.5)
    lowered = root / "lowered"
    result = invoke_gmc("lower", artifact, "--compile", "--max-len", "32", "-o", lowered)
    assert result.exit_code == 0, result.output
    assert "compiled prefill/decode programs, 32 positions" in result.stdout
    return artifact, lowered


def _generated(result) -> tuple[str, str]:
    """``(text, speed line)`` of a successful ``gmc generate``."""
    assert result.exit_code == 0, result.output
    speed = result.stderr.strip().splitlines()[-1]
    return result.stdout.strip(), speed


def test_generate_from_a_model_directory_prints_text_and_speed(tiny_model_dir):
    text, speed = _generated(invoke_gmc("generate", tiny_model_dir, "--prompt", "hello", "--max-new-tokens", "5"))
    assert text.startswith("hello") and len(text) > len("hello")
    assert speed.startswith("eager dense, ") and "prefill" in speed and "decode 4 tokens" in speed


def test_generate_is_greedy_by_default_and_seeded_sampling_repeats(tiny_model_dir):
    args = ("generate", tiny_model_dir, "--prompt", PROMPT, "--max-new-tokens", "8")
    assert _generated(invoke_gmc(*args))[0] == _generated(invoke_gmc(*args))[0]
    sampled = (*args, "--temperature", "1.5", "--top-k", "50", "--seed", "3")
    assert _generated(invoke_gmc(*sampled))[0] == _generated(invoke_gmc(*sampled))[0]


@pytest.mark.slow
def test_generate_from_a_masks_artifact_folds_its_masks(tiny_model_dir, compiled_workspace):
    artifact, _ = compiled_workspace
    masked, speed = _generated(invoke_gmc("generate", artifact, "--prompt", PROMPT, "--max-new-tokens", "6"))
    dense, _ = _generated(invoke_gmc("generate", tiny_model_dir, "--prompt", PROMPT, "--max-new-tokens", "6"))
    assert speed.startswith("eager masks, ") and "decode" in speed
    assert masked.startswith(PROMPT) and masked != dense  # half the groups pruned changes the greedy text


@pytest.mark.slow
def test_compiled_lowered_directory_generates_the_artifact_text(compiled_workspace):
    artifact, lowered = compiled_workspace
    assert (lowered / "compiled" / "decode.pt2").is_file()
    compiled, speed = _generated(invoke_gmc("generate", lowered, "--prompt", PROMPT, "--max-new-tokens", "5"))
    eager, _ = _generated(invoke_gmc("generate", artifact, "--prompt", PROMPT, "--max-new-tokens", "5"))
    assert speed.startswith("compiled lowered (AOTInductor, cpu)") and "decode 4 tokens" in speed
    assert compiled == eager


@pytest.mark.slow
def test_generate_compile_of_an_artifact_gives_its_eager_text(compiled_workspace):
    """``--compile`` on a masks artifact: folded, compiled on the fly into a scratch directory by
    the path ``gmc lower --compile`` runs (``lower_decode``, the head on the op), same greedy text."""
    artifact, _ = compiled_workspace
    args = ("generate", artifact, "--prompt", PROMPT, "--max-new-tokens", "5")
    compiled, speed = _generated(invoke_gmc(*args, "--compile"))
    eager, _ = _generated(invoke_gmc(*args))
    assert speed.startswith("compiled masks (AOTInductor, cpu)") and "decode 4 tokens" in speed
    assert compiled == eager


@pytest.mark.slow
def test_compiled_lowered_directory_refuses_more_than_its_positions(compiled_workspace):
    _, lowered = compiled_workspace
    result = invoke_gmc("generate", lowered, "--prompt", PROMPT, "--max-new-tokens", "40")
    assert result.exit_code == 2
    assert result.output.strip().startswith("gmc: error: prompt of ") and "cache of 32 positions" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("args, word", [
    (("--temperature", "-1"), "temperature"),
    (("--temperature", "nan"), "temperature"),
    (("--max-new-tokens", "0"), "--max-new-tokens 0"),
    (("--top-k", "0"), "--top-k 0"),
    (("--threads", "0"), "--threads"),
    (("--prompt", ""), "--prompt"),
])
def test_bad_options_are_one_line_errors(tiny_model_dir, args, word):
    result = invoke_gmc("generate", tiny_model_dir, *args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gmc: error: ") and word in lines[0]


@pytest.mark.slow
def test_lower_onnx_compile_is_refused(compiled_workspace, tmp_path):
    artifact, _ = compiled_workspace
    result = invoke_gmc("lower", artifact, "--backend", "onnx", "--compile", "-o", tmp_path / "m.onnx")
    assert result.exit_code == 2
    assert result.output.strip() == "gmc: error: --compile applies to --backend packed, not onnx"
    result = invoke_gmc("lower", artifact, "--compile", "--max-len", "1", "-o", tmp_path / "short")
    assert result.exit_code == 2 and "--max-len" in result.output
    assert not (tmp_path / "m.onnx").exists() and not (tmp_path / "short").exists()
