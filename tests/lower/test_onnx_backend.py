"""``gmc lower --backend onnx``: a directory onnxruntime-genai generates from, in a process that imports
neither torch nor gmc, the same greedy tokens as ``gmc generate`` on the artifact; the packing pass is
exact; what a directory may name is checked before anything loads."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import byte_bpe_tokenizer, invoke_gmc, mask_artifact, save_random_artifact, tiny_model

pytest.importorskip("onnxruntime_genai")
onnx = pytest.importorskip("onnx")

from gmc.errors import GmcError  # noqa: E402
from gmc.formats.onnx import GENAI_CONFIG, MODEL_FILE, check_onnx_dir, onnx_session  # noqa: E402

PROMPT = "hello world, the quick brown fox"
NEW_TOKENS = 32

# Runs in a fresh interpreter: only onnxruntime and onnxruntime-genai (and the directory's own op library).
GENAI_GREEDY = textwrap.dedent("""
    import json, sys
    import onnxruntime_genai as og
    directory, ids, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    model = og.Model(og.Config(directory))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + new)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    out = []
    while not generator.is_done() and len(out) < new:
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    assert not {"torch", "gmc"} & set(sys.modules), "the deployment process imported torch or gmc"
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """``(model_dir, artifact_dir, model)``: a tiny Llama and random 1x16 masks keeping half its groups
    (its MLP is 336 wide: a linear as wide as the 320-token vocabulary is refused, below)."""
    root = tmp_path_factory.mktemp("onnx")
    model = tiny_model("llama", hidden_size=128, intermediate_size=336)
    model.save_pretrained(root / "model")
    byte_bpe_tokenizer().save_pretrained(root / "model")
    artifact = save_random_artifact(root / "masks", str(root / "model"), model, keep=0.5)
    return root / "model", artifact, model


def _lower(workspace, output, *extra):
    _, artifact, _ = workspace
    result = invoke_gmc("lower", artifact, "--backend", "onnx", "--quiet", "-o", output, *extra)
    assert result.exit_code == 0, result.output
    return output


@pytest.fixture(scope="module")
def standard_dir(workspace, tmp_path_factory):
    return _lower(workspace, tmp_path_factory.mktemp("std") / "onnx", "--onnx-standard-ops")


@pytest.fixture(scope="module")
def native_dir(workspace, tmp_path_factory):
    from gmc.kernels.ort_ops import library_path, why_not

    if library_path() is None:
        pytest.skip(f"gmc's ONNX Runtime op library is not built here: {why_not()}")
    return _lower(workspace, tmp_path_factory.mktemp("native") / "onnx")


def _gmc_greedy(artifact) -> tuple[list[int], list[int]]:
    """(prompt ids, new ids) of ``gmc generate`` on the artifact (masks folded into the base), fp32."""
    result = invoke_gmc("generate", artifact, "--no-chat", "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
                        "--dtype", "float32", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout.strip().splitlines()[-1])
    return record["tokens"]


def _genai_greedy(directory, ids) -> list[int]:
    done = subprocess.run([sys.executable, "-c", GENAI_GREEDY, str(directory), json.dumps(ids), str(NEW_TOKENS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _prompt_ids(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]


def _logits(directory, ids) -> np.ndarray:
    """Logits [1, S, V] of the directory's decoder over ``ids`` from an empty cache."""
    session = onnx_session(directory)
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for item in session.get_inputs():
        if item.name.startswith("past_key_values"):
            heads, dim = item.shape[1], 32
            feeds[item.name] = np.zeros((1, heads, 0, dim), np.float32)
    return session.run(["logits"], feeds)[0]


def _folded_logits(workspace, ids) -> torch.Tensor:
    from gmc.formats.artifact import load_artifact
    from gmc.graph.pipeline import fold

    _, artifact_dir, model = workspace
    artifact = load_artifact(artifact_dir)
    folded = fold(model, artifact.masks, artifact.pattern, artifact.weights)
    with torch.no_grad():
        return folded(torch.tensor([ids]))


@pytest.mark.slow  # lowers with standard ops (the op's nodes: tests/kernels/test_onnx_group_sparse.py)
def test_standard_ops_directory_is_what_genai_loads(standard_dir, workspace):
    model_dir, _, _ = workspace
    config = check_onnx_dir(standard_dir)
    assert config["model"]["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert "custom_ops_library" not in config["model"]["decoder"]["session_options"]
    graph = onnx.load(str(standard_dir / MODEL_FILE), load_external_data=False).graph
    assert not [n for n in graph.node if n.domain == "gmc"]
    assert len([n for n in graph.node if n.op_type == "ScatterElements"]) == 2 * 5  # qkv, o, gate, up, down
    meta = json.loads((standard_dir / "gmc_onnx.json").read_text())
    assert meta["op"] == "standard ONNX ops" and meta["group"] == "1x16" and meta["packed_layers"] == 10
    assert (standard_dir / "tokenizer.json").is_file() and (standard_dir / ".gmc-output").is_file()


@pytest.mark.slow  # lowers with standard ops (the op's nodes: tests/kernels/test_onnx_group_sparse.py)
def test_packing_is_exact_and_keeps_what_the_masks_keep(standard_dir, workspace):
    """Logits of the packed graph are the folded model's; the pass keeps exactly the masks' groups."""
    from gmc.formats.artifact import load_artifact

    model_dir, artifact_dir, model = workspace
    ids = _prompt_ids(model_dir)
    torch.testing.assert_close(torch.from_numpy(_logits(standard_dir, ids)), _folded_logits(workspace, ids),
                               atol=1e-4, rtol=1e-4)
    artifact = load_artifact(artifact_dir)
    kept = sum(int((artifact.pattern.expand(m, tuple(model.get_submodule(n).weight.shape))).sum())
               for n, m in artifact.masks.items())
    assert json.loads((standard_dir / "gmc_onnx.json").read_text())["kept_weights"] == kept


@pytest.mark.slow  # lowers with standard ops (the op's nodes: tests/kernels/test_onnx_group_sparse.py)
def test_genai_generates_gmc_generate_s_tokens(standard_dir, workspace):
    """The acceptance check: a process with only onnxruntime-genai produces gmc generate's greedy tokens."""
    model_dir, artifact, _ = workspace
    assert _genai_greedy(standard_dir, _prompt_ids(model_dir)) == _gmc_greedy(artifact)


def test_native_op_directory_carries_its_library_and_generates_the_same_tokens(native_dir, workspace):
    model_dir, artifact, _ = workspace
    config = check_onnx_dir(native_dir)
    assert config["model"]["decoder"]["session_options"]["custom_ops_library"] == "libgmc_ort_ops.so"
    assert config["gmc_library"] == (native_dir / "libgmc_ort_ops.so").resolve()
    graph = onnx.load(str(native_dir / MODEL_FILE), load_external_data=False).graph
    assert len([n for n in graph.node if (n.domain, n.op_type) == ("gmc", "GroupSparseLinear")]) == 2 * 5
    assert not [n for n in graph.node if n.op_type == "MatMul" and n.output[0] != "logits"]  # the head stays
    ids = _prompt_ids(model_dir)
    torch.testing.assert_close(torch.from_numpy(_logits(native_dir, ids)), _folded_logits(workspace, ids),
                               atol=1e-4, rtol=1e-4)
    assert _genai_greedy(native_dir, ids) == _gmc_greedy(artifact)


@pytest.mark.slow  # lowers again / opens onnxruntime-genai per thread count
@pytest.mark.parametrize("how,tolerance", [("int8", 0.05), ("int4", 0.25)])
def test_quantized_directories_run_on_the_native_op(native_dir, workspace, tmp_path, how, tolerance):
    """Targets int8 / int4 on gmc's op, the head int8 (as the packed backend's); logits near the float ones."""
    model_dir, _, _ = workspace
    out = _lower(workspace, tmp_path / how, "--quantize", how)
    graph = onnx.load(str(out / MODEL_FILE), load_external_data=False).graph
    ops = [n for n in graph.node if n.domain == "gmc"]
    assert len(ops) == 2 * 5 + 1 and ops[-1].output[0] == "logits" and all(len(n.input) == 6 for n in ops)
    ids = _prompt_ids(model_dir)
    got, expected = _logits(out, ids), _logits(native_dir, ids)
    assert np.abs(got - expected).max() < tolerance * np.abs(expected).max() and not np.array_equal(got, expected)
    assert json.loads((out / "gmc_onnx.json").read_text())["quantize"] == how


def test_a_tampered_library_is_refused_before_it_loads(native_dir, tmp_path):
    copy = _copy(native_dir, tmp_path)
    library = copy / "libgmc_ort_ops.so"
    library.write_bytes(library.read_bytes() + b"\0")
    with pytest.raises(GmcError, match="its sha256 differs from its stamp's"):
        check_onnx_dir(copy)
    (copy / "libgmc_ort_ops.json").unlink()
    with pytest.raises(GmcError, match="gmc loads only op libraries it built and stamped"):
        onnx_session(copy)


def test_quantize_with_standard_ops_is_refused_in_one_line(workspace, tmp_path):
    _, artifact, _ = workspace
    result = invoke_gmc("lower", artifact, "--backend", "onnx", "--onnx-standard-ops", "--quantize", "int4",
                        "-o", tmp_path / "q")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "gmc: error: --quantize int4 needs the gmc.GroupSparseLinear op: standard ONNX ops run float weights "
        "(drop --onnx-standard-ops, or --quantize none)"]
    assert not (tmp_path / "q").exists()


@pytest.fixture
def small_dir(tmp_path):
    """A directory with what ``check_onnx_dir`` reads: a config and a one-node model (no builder run)."""
    from onnx import TensorProto, helper

    directory = tmp_path / "small"
    directory.mkdir()
    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [value],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), str(directory / MODEL_FILE))
    config = {"model": {"decoder": {"filename": MODEL_FILE, "session_options": {}}, "vocab_size": 8}}
    (directory / GENAI_CONFIG).write_text(json.dumps(config))
    return directory


def _copy(directory, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(directory, target)
    return target


def _edit_config(directory, **session_options):
    path = directory / GENAI_CONFIG
    config = json.loads(path.read_text())
    config["model"]["decoder"]["session_options"].update(session_options)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("library", ["/usr/lib/libsomething.so", "../outside.so", "sub/../../x.so"])
def test_a_library_outside_the_directory_is_refused(small_dir, tmp_path, library):
    copy = small_dir
    (tmp_path / "outside.so").write_bytes(b"\x7fELF")
    _edit_config(copy, custom_ops_library=library)
    with pytest.raises(GmcError, match=r"outside the model directory: gmc loads only files inside"):
        check_onnx_dir(copy)
    with pytest.raises(GmcError, match="outside the model directory"):
        onnx_session(copy)


def test_a_missing_or_corrupted_model_file_is_one_line(small_dir, tmp_path):
    copy = small_dir
    (copy / MODEL_FILE).write_bytes(b"not a protobuf at all" * 10)
    with pytest.raises(GmcError, match=r"model.onnx is not a readable ONNX model .*corrupted; lower it again"):
        check_onnx_dir(copy)
    (copy / MODEL_FILE).unlink()
    with pytest.raises(GmcError, match=r"has no model file 'model.onnx': the directory is incomplete"):
        check_onnx_dir(copy)
    (copy / GENAI_CONFIG).write_text("{")
    with pytest.raises(GmcError, match=r"genai_config.json is not a valid onnxruntime-genai config"):
        check_onnx_dir(copy)
    with pytest.raises(GmcError, match=r"is not an ONNX model directory"):
        check_onnx_dir(tmp_path)


def test_a_linear_as_wide_as_the_vocabulary_is_refused(tmp_path):
    """The model builder would wire such a linear as the head: refused before anything is written."""
    model = tiny_model("llama", hidden_size=128, intermediate_size=320)  # gate/up: 320 outputs = vocab_size
    model.save_pretrained(tmp_path / "model")
    byte_bpe_tokenizer().save_pretrained(tmp_path / "model")
    artifact = save_random_artifact(tmp_path / "masks", str(tmp_path / "model"), model, keep=0.5)
    result = invoke_gmc("lower", artifact, "--backend", "onnx", "--onnx-standard-ops", "-o", tmp_path / "o")
    assert result.exit_code == 2
    assert "model.layers.0.mlp.gate_proj has 320 outputs, the vocabulary size" in result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # lowers with standard ops (the op's nodes: tests/kernels/test_onnx_group_sparse.py)
def test_info_describes_the_directory(standard_dir):
    from gmc.runtime.info import describe

    info = describe(str(standard_dir))
    assert info["kind"] == "onnx" and info["library"] is None and info["metadata"]["op"] == "standard ONNX ops"
    projections = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert [layer["name"] for layer in info["layers"]][:5] == [f"model.layers.0.{p}" for p in projections]
    assert all(layer["op"] == "standard ops" and layer["bytes"] > 0 for layer in info["layers"])
    assert "model.onnx.data" in info["files"] and json.loads(json.dumps(info)) == info


@pytest.mark.slow  # lowers again / opens onnxruntime-genai per thread count
def test_bench_times_the_directory_in_onnxruntime_genai(standard_dir):
    result = invoke_gmc("bench", standard_dir, "-p", "8", "-n", "4", "-r", "1", "-t", "1", "--warmup", "0",
                        "--format", "json")
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert [(r["form"], r["test"]) for r in records] == [("onnxruntime-genai", "pp8"), ("onnxruntime-genai", "tg4")]
    assert all(r["tokens_per_s"] > 0 and r["size_mib"] > 0 for r in records)


@pytest.mark.slow  # lowers again / opens onnxruntime-genai per thread count
def test_bench_names_the_gmc_op(native_dir):
    result = invoke_gmc("bench", native_dir, "-p", "4", "-n", "2", "-r", "1", "-t", "2", "--warmup", "0",
                        "--format", "json")
    assert result.exit_code == 0, result.output
    assert {r["form"] for r in json.loads(result.stdout)} == {"onnxruntime-genai (gmc op)"}


@pytest.mark.slow  # prunes, lowers and exports SmolLM2-135M (about 50 s on 2 cores)
def test_smollm2_in_onnxruntime_genai_generates_gmc_generate_s_tokens(smollm2, tmp_path):
    """The bundled model pruned to 1x256 at 50% (gmc's op; standard ops: with the tiny model above):
    onnxruntime-genai, in a process without torch or gmc, gives the greedy tokens of ``gmc generate``
    on the same masks artifact, fp32, 32 new tokens."""
    from gmc.formats.artifact import save_artifact
    from gmc.groups import parse_pattern
    from gmc.inputs.model import _smollm2_hf_dir

    hf_dir = _smollm2_hf_dir()
    pattern, generator = parse_pattern("1x256"), torch.Generator().manual_seed(0)
    masks = {name: torch.rand(pattern.grid(tuple(module.weight.shape)), generator=generator) < 0.5
             for name, module in smollm2.model.named_modules() if name.endswith("_proj")}
    artifact = save_artifact(tmp_path / "masks", mask_artifact(smollm2.model, masks, pattern, "smollm2-135m"))
    ids = _prompt_ids(hf_dir)
    lowered = invoke_gmc("lower", artifact, "--backend", "onnx", "--quiet", "-o", tmp_path / "onnx")
    assert lowered.exit_code == 0, lowered.output
    assert _genai_greedy(tmp_path / "onnx", ids) == _gmc_greedy(artifact)
