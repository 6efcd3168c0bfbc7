"""``gmc generate`` on a tiny HF directory, a masks artifact and a ``gmc lower --compile`` output: text on
stdout, one speed line on stderr, one-line errors; the prompt from a file or stdin, ``--json``, chat with a
tokenizer's template (one turn, ``-i`` from piped input, and ``-i`` on the bundled SmolLM2 in a
pseudo-terminal). One compile (module fixture) serves every test but the one of ``--compile`` itself."""
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import invoke_gmc, save_random_artifact, save_tiny_smol, tiny_model

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
    (("--top-p", "0"), "--top-p 0.0"),
    (("--top-p", "1.1"), "--top-p 1.1"),
    (("--repetition-penalty", "0"), "--repetition-penalty 0.0"),
    (("--max-len", "1"), "--max-len 1"),
    (("--prompt", "x", "--prompt-file", "p.txt"), "--prompt or --prompt-file, not both"),
    (("--prompt-file", "/no/such/prompt.txt"), "--prompt-file /no/such/prompt.txt"),
    (("-i", "--no-chat"), "-i"),
    (("-i", "--prompt", "-"), "-i"),
    (("-i", "--json"), "--json"),
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


def _invoke_with_stdin(text: str, *args):
    from click.testing import CliRunner

    from gmc.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args], input=text)


def test_the_prompt_comes_from_a_file_or_stdin(tiny_model_dir, tmp_path):
    args = ("generate", tiny_model_dir, "--max-new-tokens", "6")
    given, _ = _generated(invoke_gmc(*args, "--prompt", "the quick fox"))
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("the quick fox\n")  # the file's last line end is not part of the prompt
    assert _generated(invoke_gmc(*args, "--prompt-file", prompt_file))[0] == given
    assert _generated(_invoke_with_stdin("the quick fox\n", *args, "--prompt", "-"))[0] == given
    assert _generated(_invoke_with_stdin("the quick fox", *args, "--prompt-file", "-"))[0] == given
    prompt_file.write_text("\n")
    result = invoke_gmc(*args, "--prompt-file", prompt_file)
    assert result.exit_code == 2 and result.output.strip() == f"gmc: error: empty prompt in {prompt_file}"


def test_json_prints_one_summary_instead_of_the_text_and_speed_line(tiny_model_dir):
    args = ("generate", tiny_model_dir, "--prompt", PROMPT, "--max-new-tokens", "5")
    text, _ = _generated(invoke_gmc(*args))
    result = invoke_gmc(*args, "--json")
    assert result.exit_code == 0 and "prefill" not in result.stderr
    summary = json.loads(result.stdout)
    assert summary["text"] == text and summary["chat"] is False and summary["how"] == "eager dense"
    assert len(summary["tokens"]) == summary["new_tokens"] == 5 and summary["prompt_tokens"] > 0
    assert summary["prefill_tokens_per_s"] > 0 and summary["decode_tokens_per_s"] > 0 and summary["threads"] >= 1


@pytest.mark.parametrize("option, why", [
    ("--chat", "--chat: the tokenizer of {} has no chat template; leave out --chat to continue the prompt as text"),
    ("-i", "-i chats in the tokenizer's chat template, and the tokenizer of {} has none"),
])
def test_chat_with_a_tokenizer_without_a_chat_template_is_refused(tiny_model_dir, option, why):
    result = invoke_gmc("generate", tiny_model_dir, option)
    assert result.exit_code == 2 and result.stdout == ""
    error = result.stderr.strip().splitlines()[-1]  # after transformers' bar of the weights it loaded
    assert error == "gmc: error: " + why.format(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer, so with its chat template."""
    return save_tiny_smol(tmp_path_factory.mktemp("chat") / "smol")


def test_a_tokenizer_with_a_chat_template_chats_by_default(tiny_chat_dir):
    args = ("generate", tiny_chat_dir, "--prompt", "Hi", "--max-new-tokens", "6", "--json")
    chat = json.loads(_generated(invoke_gmc(*args))[0])
    plain = json.loads(_generated(invoke_gmc(*args, "--no-chat"))[0])
    forced = json.loads(_generated(invoke_gmc(*args, "--chat"))[0])
    assert (chat["text"], chat["tokens"]) == (forced["text"], forced["tokens"])
    assert chat["chat"] is True and plain["chat"] is False
    assert chat["prompt_tokens"] > plain["prompt_tokens"] + 10  # the template's system turn and markers
    assert plain["text"].startswith("Hi") and chat["tokens"] != plain["tokens"]
    streamed, speed = _generated(invoke_gmc(*args[:-1]))
    assert streamed == chat["text"].strip() and speed.startswith("eager dense, ")


def test_interactive_chat_from_piped_lines_keeps_the_conversation(tiny_chat_dir):
    result = _invoke_with_stdin("Hello\nHow are you?\n", "generate", tiny_chat_dir, "-i", "--max-new-tokens", "4",
                                "--prompt", "First")
    assert result.exit_code == 0, result.output
    assert result.stdout.count(">>> ") == 3  # after the --prompt turn, after Hello, before the end of input
    speeds = [line for line in result.stderr.splitlines() if line.startswith("prefill ")]
    prompts = [int(line.split()[1]) for line in speeds]
    assert len(prompts) == 3 and prompts[0] < prompts[1] < prompts[2]  # each turn prefills the whole conversation


def _read_until(terminal: int, marker: str, seen: list, timeout: float) -> str:
    """What the program behind pty ``terminal`` writes until ``marker`` (or its end), appended to ``seen``."""
    import select

    deadline = time.monotonic() + timeout
    text = ""
    while marker not in text:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} within {timeout} s; the terminal shows:\n{''.join(seen) + text}"
        if select.select([terminal], [], [], left)[0]:
            try:
                chunk = os.read(terminal, 4096).decode("utf-8", "replace")
            except OSError:  # EIO: the program closed the terminal
                chunk = ""
            if not chunk:
                break
            text += chunk
    seen.append(text)
    return text


@pytest.mark.slow
def test_interactive_chat_with_smollm2_in_a_terminal():
    """``gmc generate smollm2-135m --chat -i`` in a pseudo-terminal, as a user types: a reply streams to a
    first message, a second turn follows, Ctrl-D at the marker exits with status 0."""
    terminal, child = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "gmc", "generate", "smollm2-135m", "--chat", "-i",
                             "--max-new-tokens", "8"], stdin=child, stdout=child, stderr=child, close_fds=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", "TERM": "dumb"})
    os.close(child)
    seen = []
    try:
        _read_until(terminal, ">>> ", seen, timeout=120)  # loading the model
        os.write(terminal, b"What is the capital of France?\n")
        first = _read_until(terminal, ">>> ", seen, timeout=60)
        os.write(terminal, b"And of Italy?\n")
        second = _read_until(terminal, ">>> ", seen, timeout=60)
        os.write(terminal, b"\x04")
        _read_until(terminal, "never printed", seen, timeout=30)  # to the end of its output
        assert proc.wait(timeout=30) == 0, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(terminal)
    replies = []
    for turn, typed in ((first, "France?"), (second, "Italy?")):
        reply, speed = turn.split(typed, 1)[1].split("prefill ", 1)  # the echoed line, the reply, its speed line
        replies.append(reply.strip())
        assert "tok/s" in speed
    assert all(replies) and replies[0] != replies[1], replies
    prompts = [int(turn.split("prefill ", 1)[1].split()[0]) for turn in (first, second)]
    assert prompts[1] > prompts[0] + 8  # the second turn prefills the first exchange too
