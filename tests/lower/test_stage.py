"""The lowering stage: the backend table, what each backend refuses, and a backend added as one class."""
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import letters_tokenizer, mask_artifact, masked_copy, random_masks, tiny_model

from gmc.errors import GmcError
from gmc.formats.artifact import save_artifact
from gmc.groups import parse_pattern
from gmc.lower import backends
from gmc.lower.backend import Backend, LowerResult, target_bytes
from gmc.lower.stage import LowerConfig, lower_artifact

FIELDS = {f.name: f for f in dataclasses.fields(LowerConfig)}
SET = {"quantize": "int8", "compile": True, "max_len": 64, "onnx_standard_ops": True}  # each away from its default


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """``(artifact_dir, masked dense copy)`` of a tiny Llama saved with its tokenizer."""
    tmp = tmp_path_factory.mktemp("stage")
    model = tiny_model("llama", intermediate_size=128, vocab_size=256)
    model.save_pretrained(tmp / "tiny")
    letters_tokenizer().save_pretrained(tmp / "tiny")
    spec = parse_pattern("1x16")
    masks = random_masks(model, spec)
    return save_artifact(tmp / "masks", mask_artifact(model, masks, spec, str(tmp / "tiny"))), masked_copy(
        model, masks, spec)


def test_every_backend_names_its_kind_devices_and_only_config_fields():
    assert set(backends.BACKENDS) == {"packed", "onnx", "dense"}
    for name, backend in backends.BACKENDS.items():
        assert backend.name == name and backend.kind and backend.help and backend.devices
        assert set(backend.options) <= set(FIELDS)
    assert set(SET) == {option for b in backends.BACKENDS.values() for option in b.options}


@pytest.mark.parametrize("backend", sorted(backends.BACKENDS))
@pytest.mark.parametrize("option", sorted(SET))
def test_an_option_only_another_backend_reads_is_refused(tmp_path, backend, option):
    config = dict(backend=backend, device="cpu", **{option: SET[option]})
    if option == "max_len" and backend == "packed":
        config["compile"] = True
    if option in backends.BACKENDS[backend].options or (option == "max_len" and backend == "packed"):
        assert LowerConfig("art", str(tmp_path / "out"), **config).backend == backend
        return
    with pytest.raises(GmcError, match=f"--{option.replace('_', '-')}.* applies to --backend .*, not {backend}"):
        LowerConfig("art", str(tmp_path / "out"), **config)


def test_torch_and_triton_name_the_packed_backend_on_a_device(tmp_path):
    config = LowerConfig("art", str(tmp_path / "out"), backend="torch")
    assert (config.backend, config.device, config.dtype) == ("packed", "cpu", "float32")
    with pytest.raises(GmcError, match="--backend triton is the packed backend for --device cuda"):
        LowerConfig("art", str(tmp_path / "out"), backend="triton", device="cpu")
    with pytest.raises(GmcError, match="--compile builds CPU packages"):  # refused before CUDA is looked for
        LowerConfig("art", str(tmp_path / "out"), device="cuda", compile=True)
    if not torch.cuda.is_available():
        with pytest.raises(GmcError, match="use --device cpu"):
            LowerConfig("art", str(tmp_path / "out"), backend="triton")


def test_dense_takes_n_m_masks_and_the_packing_backends_refuse_them():
    nm = parse_pattern("2:4")
    backends.BACKENDS["dense"].check_pattern(nm)
    for name in ("packed", "onnx"):
        with pytest.raises(GmcError, match="cannot lower the N:M pattern 2:4"):
            backends.BACKENDS[name].check_pattern(nm)


class _StateDictBackend(Backend):
    """The example of docs/design.md, "Adding a lowering backend": the folded weights as one file."""

    name = "state-dict"
    help = "the folded weights as one safetensors file"
    kind = "dense"
    devices = ("cpu",)
    group_patterns_only = False

    def write(self, config, artifact, loaded, steps) -> LowerResult:
        from safetensors.torch import save_file

        from gmc.formats.atomic import atomic_dir
        from gmc.graph.pipeline import fold

        steps("folding and saving")  # one step: the default of Backend.steps
        fold(loaded.model, artifact.masks, artifact.pattern, artifact.weights, in_place=True)
        dense = target_bytes(loaded.model, artifact.masks)
        with atomic_dir(config.output, self.kind, config.overwrite) as tmp:
            state = {name: tensor.contiguous() for name, tensor in loaded.model.state_dict().items()
                     if name != "lm_head.weight"}  # tied to the embedding: safetensors stores it once
            save_file(state, str(Path(tmp) / "model.safetensors"))
        return LowerResult(Path(config.output), dense, dense)


def test_a_backend_is_one_class_and_one_table_entry(artifact, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    directory, dense = artifact
    monkeypatch.setitem(backends.BACKENDS, "state-dict", _StateDictBackend())
    result = lower_artifact(LowerConfig(str(directory), str(tmp_path / "out"), backend="state-dict"))
    weights = load_file(result.path / "model.safetensors")
    expected = dense.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(weights[name], expected[name])
    assert (weights[name] == 0).any() and result.packed_bytes == result.dense_bytes
