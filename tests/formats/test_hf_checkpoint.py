"""A packed model is an ordinary HF checkpoint: from_pretrained / pipeline / generate / lm-eval after
``import gmc.formats.hf_checkpoint``, save_pretrained round trips, refusals in one line."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    invoke_gmc,
    letters_tokenizer,
    masked_copy,
    random_masks,
    smol_tokenizer,
    tiny_model,
    tiny_smol_model,
    write_text,
    x_quantized,
)

import gmc.formats.hf_checkpoint  # noqa: F401  (registers the quantizer)
from gmc.errors import GmcError
from gmc.formats.hf_checkpoint import REFUSAL, attach_packed_config
from gmc.formats.lowered import load_lowered, save_lowered
from gmc.graph.pipeline import pack_targets
from gmc.groups import GroupSpec
from gmc.kernels.linear import GroupSparseLinear, swap_group_sparse_linears
from gmc.kernels.quantize import quantize

SPEC = GroupSpec(1, 16)


def _packed_dir(path: Path, how: str = "none", tokenizer=None, model=None):
    """A tiny packed checkpoint in ``path``, its values stored as ``how`` (none, int8, int4), and
    the dense model it must equal (quantized: dequantized)."""
    model = model if model is not None else tiny_model("llama", intermediate_size=128, vocab_size=256)
    masks = random_masks(model, SPEC)
    dense = masked_copy(model, masks, SPEC)
    packed = pack_targets(model, masks, SPEC)
    if how != "none":
        packed = {name: quantize(layer, how) for name, layer in packed.items()}
        for name, layer in packed.items():
            dense.get_submodule(name).weight.data = layer.unpack()
    save_lowered(path, model, tokenizer, packed, {"model": "tiny", "group": str(SPEC), "method": "random"})
    return dense


def _run(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300)


LOAD_AND_SAVE_LOGITS = """
import sys, torch
import gmc.formats.hf_checkpoint
from transformers import AutoModelForCausalLM
from gmc.kernels.linear import GroupSparseLinear
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
assert sum(isinstance(m, GroupSparseLinear) for m in model.modules()) == 14
assert not any(isinstance(m, torch.nn.Linear) and 'proj' in n for n, m in model.named_modules())
ids = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    torch.save(model(ids).logits, sys.argv[3])
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["none", "int8", "int4"])
def test_fresh_process_loads_the_packed_checkpoint_like_the_folded_model(tmp_path, how):
    dense = _packed_dir(tmp_path / "ckpt", how)
    ids = torch.randint(0, 256, (2, 7))
    torch.save(ids, tmp_path / "ids.pt")
    result = _run(LOAD_AND_SAVE_LOGITS, tmp_path / "ckpt", tmp_path / "ids.pt", tmp_path / "logits.pt")
    assert result.returncode == 0, result.stderr[-2000:]
    with torch.no_grad():
        expected = dense(ids).logits
    tolerance = dict(atol=1e-5, rtol=1e-5) if how == "none" else x_quantized(expected)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, **tolerance)


def test_checkpoint_files_and_config(tmp_path):
    _packed_dir(tmp_path, "int8")
    names = {p.name for p in tmp_path.iterdir()}
    assert "model.safetensors" in names and "pytorch_model.bin" not in names
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["transformers_weights"] == REFUSAL
    quantization = config["quantization_config"]
    assert quantization["quant_method"] == "gmc" and quantization["format_version"] == 3
    assert quantization["provenance"]["method"] == "random"
    info = quantization["layers"]["model.layers.0.self_attn.q_proj"]
    assert info["shape"] == [64, 64] and info["group"] == "1x16" and info["dtype"] == "int8"
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as handle:
        keys = set(handle.keys())
    prefix = "model.layers.0.self_attn.q_proj"
    assert {f"{prefix}.values", f"{prefix}.group_idx", f"{prefix}.group_ptr", f"{prefix}.scales"} <= keys
    assert f"{prefix}.weight" not in keys and not [key for key in keys if "row_" in key]


@pytest.mark.parametrize("how", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_pretrained_dtype_and_device_map(tmp_path, dtype, how):
    from transformers import AutoModelForCausalLM

    dense = _packed_dir(tmp_path, how)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, device_map="auto")
    layers = [m for m in model.modules() if isinstance(m, GroupSparseLinear)]
    stored = {"int8": (torch.int8, torch.float32), "int4": (torch.uint8, torch.float16)}[how]
    assert len(layers) == 14 and all((m.values.dtype, m.scales.dtype) == stored for m in layers)
    assert model.model.embed_tokens.weight.dtype == dtype
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        got, expected = model(ids).logits.float(), dense(ids).logits
    limit = 0.02 if dtype == torch.float32 else 0.05  # x quantized (conftest.x_quantized), bf16 rounded
    assert (got - expected).abs().max() <= limit * max(1.0, expected.abs().max().item())


def test_save_pretrained_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM

    dense = _packed_dir(tmp_path / "a")
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    first.save_pretrained(tmp_path / "b")
    second = AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    assert second.config.quantization_config.layers == first.config.quantization_config.layers
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(second(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)


def test_attach_packed_config_marks_an_in_memory_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    masks = random_masks(model, SPEC)
    dense = masked_copy(model, masks, SPEC)
    swap_group_sparse_linears(model, pack_targets(model, masks, SPEC))
    attach_packed_config(model, {"method": "random"})
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.quantization_config.provenance == {"method": "random"}
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(GmcError, match="swap"):
        attach_packed_config(tiny_model("llama"))


def test_generate_with_hf_cache_and_pipeline_match_the_folded_model(tmp_path):
    from transformers import AutoModelForCausalLM, pipeline

    tokenizer = smol_tokenizer()
    dense = _packed_dir(tmp_path, tokenizer=tokenizer, model=tiny_smol_model())
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([tokenizer("The packed model")["input_ids"]])
    with torch.no_grad():
        expected = dense.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
        got = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
    assert torch.equal(got, expected)
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    text = generator("The packed model", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text == tokenizer.decode(expected[0], skip_special_tokens=True)


@pytest.mark.slow
def test_lm_eval_loglikelihood_on_the_packed_checkpoint(tmp_path):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM

    tokenizer = smol_tokenizer()
    dense = _packed_dir(tmp_path, tokenizer=tokenizer, model=tiny_smol_model())
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    requests = [Instance("loglikelihood", {}, ("The cat sat on the", " mat"), 0),
                Instance("loglikelihood", {}, ("Group sparsity keeps", " blocks"), 1)]
    got = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1).loglikelihood(requests)
    expected = HFLM(pretrained=dense, tokenizer=tokenizer, batch_size=1).loglikelihood(requests)
    for (a, greedy_a), (b, greedy_b) in zip(got, expected):
        assert abs(a - b) < 1e-4 and greedy_a == greedy_b


PIPELINE_AND_HFLM = """
import json, sys
import gmc
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
generator = pipeline("text-generation", model=sys.argv[1], device="cpu")
text = generator("The packed model", max_new_tokens=8, do_sample=False)[0]["generated_text"]
model, tokenizer = AutoModelForCausalLM.from_pretrained(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[1])
requests = [Instance("loglikelihood", {}, ("The cat sat on the", " mat"), 0)]
scores = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1).loglikelihood(requests)
print(json.dumps({"text": text, "scores": [[float(s), bool(g)] for s, g in scores]}))
"""


@pytest.mark.slow
def test_fresh_process_runs_pipeline_and_hflm_on_the_checkpoint(tmp_path):
    """What a user runs after ``import gmc``: ``pipeline`` and lm-eval's ``HFLM``, in a process of its own."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    tokenizer = smol_tokenizer()
    dense = _packed_dir(tmp_path, tokenizer=tokenizer, model=tiny_smol_model())
    result = _run(PIPELINE_AND_HFLM, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    ids = torch.tensor([tokenizer("The packed model")["input_ids"]])
    with torch.no_grad():
        expected = dense.generate(ids, max_new_tokens=8, do_sample=False)
    assert got["text"] == tokenizer.decode(expected[0], skip_special_tokens=True)
    requests = [Instance("loglikelihood", {}, ("The cat sat on the", " mat"), 0)]
    [(score, greedy)] = HFLM(pretrained=dense, tokenizer=tokenizer, batch_size=1).loglikelihood(requests)
    assert abs(got["scores"][0][0] - score) < 1e-4 and got["scores"][0][1] == greedy


@pytest.mark.slow
@pytest.mark.parametrize("written_by", ["gmc lower", "save_pretrained of a loaded model",
                                        "save_pretrained of a marked model"])
def test_loading_without_gmc_fails_naming_import_gmc(tmp_path, written_by):
    from transformers import AutoModelForCausalLM

    _packed_dir(tmp_path / "lowered")
    path = tmp_path / "lowered"
    if written_by == "save_pretrained of a loaded model":
        path = tmp_path / "resaved"
        AutoModelForCausalLM.from_pretrained(tmp_path / "lowered").save_pretrained(path)
    elif written_by == "save_pretrained of a marked model":
        path = tmp_path / "marked"
        model = tiny_model("llama", intermediate_size=128, vocab_size=256)
        swap_group_sparse_linears(model, pack_targets(model, random_masks(model, SPEC), SPEC))
        attach_packed_config(model).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["transformers_weights"] == REFUSAL
    code = ("import sys\nfrom transformers import AutoModelForCausalLM\n"
            "AutoModelForCausalLM.from_pretrained(sys.argv[1])")
    result = _run(code, path)
    assert result.returncode != 0
    assert "import gmc" in result.stderr.strip().splitlines()[-1], result.stderr[-1000:]


def test_pickled_weights_are_refused_in_one_line(tmp_path):
    from transformers import AutoModelForCausalLM

    _packed_dir(tmp_path)
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(GmcError, match="pytorch_model.bin") as error:
        load_lowered(tmp_path)
    assert len(str(error.value).splitlines()) == 1
    with pytest.raises(GmcError, match="pytorch_model.bin.*safetensors weights only"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def _as_version(path: Path, version: int) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["format_version"] = version
    (path / "config.json").write_text(json.dumps(config))


def test_older_checkpoint_with_row_major_int8_is_refused_in_one_line(tmp_path):
    _packed_dir(tmp_path, "int8")
    _as_version(tmp_path, 2)
    with pytest.raises(GmcError, match="v2 stores int8 layer .* row-major.*re-run `gmc lower`") as error:
        load_lowered(tmp_path)
    assert len(str(error.value).splitlines()) == 1


def test_older_checkpoint_without_int8_loads_as_the_current_format(tmp_path):
    """Float and int4 layers are stored as they were: a v2 checkpoint of them loads, and saves as v3."""
    dense = _packed_dir(tmp_path, "int4")
    _as_version(tmp_path, 2)
    model = load_lowered(tmp_path)[0]
    assert model.config.quantization_config.format_version == 3
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        expected = dense(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, **x_quantized(expected))


def test_auto_map_is_refused_in_one_line(tmp_path):
    _packed_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "modeling_evil.py").write_text("raise SystemExit('code from the checkpoint ran')\n")
    with pytest.raises(GmcError, match="auto_map") as error:
        load_lowered(tmp_path)
    assert len(str(error.value).splitlines()) == 1


def test_missing_packed_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _packed_dir(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.group_idx"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(GmcError, match="lacks model.layers.1.mlp.up_proj.group_idx.*gmc lower"):
        load_lowered(tmp_path)


@pytest.fixture(scope="module", params=["none", "int8", "int4"])
def packed_checkpoint(request, tmp_path_factory) -> Path:
    """A packed checkpoint with a tokenizer (what `gmc eval` and `gmc generate` read), values as the param."""
    path = tmp_path_factory.mktemp(f"packed-{request.param}")
    _packed_dir(path, request.param, tokenizer=letters_tokenizer())
    return path


TARGET = "model.layers.0.self_attn.q_proj"  # 64 x 64 in 1x16 groups: 64 output groups, 4 input blocks


def _tamper(tensors: dict, broken: str) -> str:
    """Break one index tensor of ``TARGET`` in ``tensors`` as ``broken`` says; the words its error gives."""
    idx, ptr = tensors[f"{TARGET}.group_idx"], tensors[f"{TARGET}.group_ptr"]
    if broken == "negative index":
        idx[5] = -3
        return f"packed layer {TARGET}: group_idx holds -3 at position 5; indices must lie in [0, 64)"
    if broken == "index past the groups":
        idx[5] = 64
        return f"packed layer {TARGET}: group_idx holds 64 at position 5; indices must lie in [0, 64)"
    ptr[2] = ptr[1] - 1
    return f"packed layer {TARGET}: group_ptr decreases at position 2 ({int(ptr[1])} then {int(ptr[2])})"


@pytest.mark.parametrize("broken", ["negative index", "index past the groups", "decreasing pointers"])
def test_tampered_indices_are_refused_in_one_line_naming_layer_and_tensor(packed_checkpoint, tmp_path, broken):
    """What loads a packed checkpoint refuses index tensors that break the layout before anything runs:
    from_pretrained with a GmcError, `gmc eval` and `gmc generate` with exit 2 and one error line."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = Path(shutil.copytree(packed_checkpoint, tmp_path / "ckpt"))
    tensors = load_file(path / "model.safetensors")
    words = _tamper(tensors, broken)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(GmcError) as error:
        AutoModelForCausalLM.from_pretrained(path)
    assert words in str(error.value) and len(str(error.value).splitlines()) == 1, str(error.value)
    text = write_text(tmp_path / "text.txt", paragraphs=4)
    for args in (("eval", path, "--ppl", text), ("generate", path, "--max-new-tokens", 2)):
        result = invoke_gmc(*args)
        lines = result.stderr.strip().splitlines()  # transformers' loading bar, then the error
        assert result.exit_code == 2 and [line for line in lines if line.startswith("gmc: ")] == lines[-1:], lines
        assert lines[-1].startswith("gmc: error: ") and words in lines[-1], lines
        assert "Traceback" not in result.output + result.stderr
