"""Bad inputs over every command: one line, exit 2, the bad value named, nothing touched.

Each case runs ``gmc`` in process (click's CliRunner; the one-line handler of ``gmc.cli.main`` is
the group's own ``main``) against one tiny model, one Wanda artifact, its lowered directory and
one checkpoint of an interrupted learned run, all built once for the module. A case may first
build a broken input in its own directory. It asserts the exit code, that no exception escaped
(no traceback), that the last line is the one ``gmc: error:`` line and names the bad value, and
that every file and directory that existed before (shared or the case's own) is unchanged.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch
from conftest import invoke_gmc
from safetensors.torch import load_file, save_file

import gmc.masks.prune
from gmc.cli.main import _one_line_warning
from gmc.formats.artifact import MANIFEST_FILE, MASKS_FILE, WEIGHTS_FILE
from gmc.inputs.calib import BUNDLED

WANDA = ("--method", "wanda", "--group", "1x64", "--seq-len", "16", "--nsamples", "2", "--quiet")
LEARNED = ("--group", "1x64", "--seq-len", "16", "--nsamples", "2", "--steps", "3", "--checkpoint-every", "1",
           "--include", r"q_proj", "--lambda", "64", "--quiet")


@pytest.fixture(autouse=True)
def _one_line_warnings(monkeypatch):
    monkeypatch.setattr(warnings, "formatwarning", _one_line_warning)  # as gmc.cli.main.main sets it


@pytest.fixture(scope="module")
def shared(tmp_path_factory, tiny_model_dir):
    """model/, calib.txt, art/ (Wanda 1x64), lowered/ and gm.ckpt/ (the checkpoint a learned run
    leaves when it is killed before its artifact is written)."""
    root = tmp_path_factory.mktemp("bad_inputs")
    model = root / "model"
    shutil.copytree(tiny_model_dir, model)
    text = root / "calib.txt"
    text.write_text("\n".join(BUNDLED["bundled"].read_text().splitlines()[:40]) + "\n")
    for args in (["prune", model, *WANDA, "--calib", text, "-o", root / "art"],
                 ["lower", root / "art", "-o", root / "lowered"]):
        result = invoke_gmc(*args)
        assert result.exit_code == 0, result.output
    with pytest.MonkeyPatch.context() as patch:  # keep the checkpoint as if the run had been killed
        patch.setattr(gmc.masks.prune, "remove_checkpoint", lambda ckpt_dir: None)
        result = invoke_gmc("prune", model, *LEARNED, "--calib", text, "-o", root / "gm")
        assert result.exit_code == 0, result.output
    shutil.rmtree(root / "gm")
    assert (root / "gm.ckpt" / "state.pt").is_file()
    return SimpleNamespace(root=root, model=model, text=text, art=root / "art", lowered=root / "lowered",
                           ckpt=root / "gm.ckpt")


# --------------------------------------------------------------------------- broken inputs


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    return dst


def edit_manifest(p, change: Callable[[dict], object], name="bad") -> Path:
    """A copy of the artifact whose manifest is ``change(manifest)`` (or the manifest changed in place)."""
    path = copy(p.art, p.tmp / name)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    new = change(manifest)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest if new is None else new))
    return path


def edit_masks(p, change: Callable[[dict], dict], file=MASKS_FILE) -> Path:
    path = copy(p.art, p.tmp / "bad")
    source = path / MASKS_FILE
    save_file(change(load_file(source)), path / file)
    return path


def truncate(path: Path, keep: float = 0.5) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def first(tensors: dict) -> str:
    return sorted(tensors)[0]


def float_masks(value):
    def change(masks):
        masks = {n: m.float() for n, m in masks.items()}
        masks[first(masks)][0, 0] = value
        return masks
    return change


def model_copy(p, change_config=None, change_weights=None) -> Path:
    path = copy(p.model, p.tmp / "model2")
    if change_config:
        config = json.loads((path / "config.json").read_text())
        change_config(config)
        (path / "config.json").write_text(json.dumps(config))
    if change_weights:
        weights = load_file(path / "model.safetensors")
        change_weights(weights)
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def off_stride_edit(weights):
    weight = weights["model.layers.0.mlp.up_proj.weight"]  # [320, 128]: the old sample read every 10th value
    weight.view(-1)[1] += 1e-3


def checkpoint_copy(p) -> Path:
    return copy(p.ckpt, p.tmp / "ck")


def resume(p, *extra):
    """A --resume of the stopped learned run, with ``extra`` options overriding its own."""
    return ["prune", p.model, *LEARNED, "--calib", p.text, "--resume", "--checkpoint-dir", p.tmp / "ck",
            "-o", p.tmp / "out", *extra]


def edit_state(p, change):
    path = checkpoint_copy(p) / "state.pt"
    state = torch.load(path, weights_only=True)
    torch.save(change(state), path)


def file_at(p, name="file.txt") -> Path:
    path = p.tmp / name
    path.write_text("not a directory\n")
    return path


def bad_lowered(p, change) -> Path:
    path = copy(p.lowered, p.tmp / "low")
    change(path)
    return path


def fill_disk(p, monkeypatch):
    import errno

    from gmc.formats import artifact

    def full(tensors, filename, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))
    monkeypatch.setattr(artifact, "save_file", full)


# --------------------------------------------------------------------------- the corpus


@dataclass
class Case:
    id: str
    args: Callable  # p -> argv (p: shared paths + p.tmp, the case's own directory)
    expect: str | tuple  # what the error line must name (every item)
    setup: Optional[Callable] = None  # p -> None: build broken inputs in p.tmp (before the snapshot)
    code: int = 2
    patch: Optional[Callable] = None  # (p, monkeypatch) -> None


def nonexistent(p):
    return p.tmp / "does-not-exist"


CASES = [
    # ---- prune: options
    Case("prune-group-zero", lambda p: ["prune", p.model, "--group", "0x256", "-o", p.tmp / "o"], "'0x256'"),
    Case("prune-group-word", lambda p: ["prune", p.model, "--group", "banana", "-o", p.tmp / "o"], "'banana'"),
    Case("prune-group-overflow", lambda p: ["prune", p.model, "--group", "1x99999999999999999999", "-o", p.tmp / "o"],
         "1x99999999999999999999"),
    Case("prune-nm-overflow", lambda p: ["prune", p.model, *WANDA[:2], "--group", "2:99999999999999999999",
                                         "-o", p.tmp / "o"], "2:99999999999999999999"),
    Case("prune-nm-learned", lambda p: ["prune", p.model, "--group", "2:4", "-o", p.tmp / "o"], "N:M"),
    Case("prune-sparsity-high", lambda p: ["prune", p.model, "--sparsity", "1.5", "-o", p.tmp / "o"], "1.5"),
    Case("prune-sparsity-nan", lambda p: ["prune", p.model, "--sparsity", "nan", "-o", p.tmp / "o"], "nan"),
    Case("prune-sparsity-negative", lambda p: ["prune", p.model, "--sparsity", "-0.2", "-o", p.tmp / "o"], "-0.2"),
    Case("prune-sparsity-text", lambda p: ["prune", p.model, "--sparsity", "half", "-o", p.tmp / "o"], "half"),
    Case("prune-steps-zero", lambda p: ["prune", p.model, "--steps", "0", "-o", p.tmp / "o"], "--steps 0"),
    Case("prune-batch-zero", lambda p: ["prune", p.model, "--batch-size", "0", "-o", p.tmp / "o"], "--batch-size 0"),
    Case("prune-lr-negative", lambda p: ["prune", p.model, "--lr", "-1", "-o", p.tmp / "o"], "--lr -1"),
    Case("prune-temperature-zero", lambda p: ["prune", p.model, "--temperature", "0", "-o", p.tmp / "o"],
         "--temperature 0"),
    Case("prune-lambda-inf", lambda p: ["prune", p.model, *LEARNED, "--calib", p.text, "--lambda", "inf",
                                        "-o", p.tmp / "o"], "inf"),
    Case("prune-seq-len-one", lambda p: ["prune", p.model, "--seq-len", "1", "-o", p.tmp / "o"], "--seq-len 1"),
    Case("prune-nsamples-zero", lambda p: ["prune", p.model, "--nsamples", "0", "-o", p.tmp / "o"], "--nsamples 0"),
    Case("prune-device-bogus", lambda p: ["prune", p.model, "--device", "bogus", "-o", p.tmp / "o"], "'bogus'"),
    Case("prune-device-cuda", lambda p: ["prune", p.model, "--device", "cuda:7", "-o", p.tmp / "o"], "cuda:7"),
    Case("prune-dtype", lambda p: ["prune", p.model, "--dtype", "float64", "-o", p.tmp / "o"], "float64"),
    Case("prune-method", lambda p: ["prune", p.model, "--method", "random", "-o", p.tmp / "o"], "random"),
    Case("prune-allocation", lambda p: ["prune", p.model, "--method", "magnitude", "--allocation", "adaptive",
                                        "-o", p.tmp / "o"], "'adaptive'"),
    Case("prune-include-regex", lambda p: ["prune", p.model, *WANDA, "--calib", p.text, "--include", "q_proj(",
                                           "-o", p.tmp / "o"], "q_proj("),
    Case("prune-include-nothing", lambda p: ["prune", p.model, *WANDA, "--calib", p.text, "--include", "nomatch",
                                             "-o", p.tmp / "o"], "nomatch"),
    Case("prune-calib-missing", lambda p: ["prune", p.model, *WANDA, "--calib", nonexistent(p) / "t.txt",
                                           "-o", p.tmp / "o"], "does-not-exist"),
    Case("prune-calib-empty", lambda p: ["prune", p.model, *WANDA, "--calib", p.tmp / "empty.txt", "-o", p.tmp / "o"],
         "empty.txt", setup=lambda p: (p.tmp / "empty.txt").write_text("")),
    Case("prune-calib-unknown", lambda p: ["prune", p.model, *WANDA, "--calib", "wikitext9", "-o", p.tmp / "o"],
         "wikitext9"),
    # ---- prune: models
    Case("prune-model-missing", lambda p: ["prune", nonexistent(p), "--calib", p.text, "-o", p.tmp / "o"],
         "does-not-exist"),
    Case("prune-model-no-config", lambda p: ["prune", p.tmp, "--method", "magnitude", "-o", p.tmp / "o"],
         "config.json"),
    Case("prune-model-file", lambda p: ["prune", p.text, "--method", "magnitude", "-o", p.tmp / "o"], "calib.txt"),
    Case("prune-model-gguf-missing", lambda p: ["prune", p.tmp / "m.gguf", "--calib", p.text, "-o", p.tmp / "o"],
         "m.gguf"),
    Case("prune-model-gguf-garbage", lambda p: ["prune", p.tmp / "m.gguf", "--method", "magnitude", "-o", p.tmp / "o"],
         "m.gguf", setup=lambda p: (p.tmp / "m.gguf").write_bytes(b"GGUF" + b"\0" * 64)),
    Case("prune-model-truncated-weights",
         lambda p: ["prune", p.tmp / "model2", "--method", "magnitude", "-o", p.tmp / "o"], "model2",
         setup=lambda p: truncate(model_copy(p) / "model.safetensors")),
    Case("prune-model-config-disagrees",
         lambda p: ["prune", p.tmp / "model2", "--method", "magnitude", "-o", p.tmp / "o"], "model2",
         setup=lambda p: model_copy(p, change_config=lambda c: c.update(intermediate_size=256))),
    Case("prune-model-config-not-json",
         lambda p: ["prune", p.tmp / "model2", "--method", "magnitude", "-o", p.tmp / "o"], "model2",
         setup=lambda p: (model_copy(p) / "config.json").write_text("{not json")),
    # ---- prune: outputs
    Case("prune-output-under-file", lambda p: ["prune", p.model, *WANDA, "--calib", p.text,
                                               "-o", p.tmp / "file.txt" / "o"], "file.txt", setup=file_at),
    Case("prune-disk-full", lambda p: ["prune", p.model, *WANDA, "--calib", p.text, "-o", p.tmp / "o"],
         ("No space left", "masks.safetensors"), patch=fill_disk),
    Case("prune-output-unrelated-dir", lambda p: ["prune", p.model, *WANDA, "--calib", p.text, "-o", p.tmp / "mine"],
         "mine", setup=lambda p: (p.tmp / "mine").mkdir() or (p.tmp / "mine" / "thesis.tex").write_text("x")),
    Case("prune-output-is-model", lambda p: ["prune", p.tmp / "model2", *WANDA, "--calib", p.text,
                                             "-o", p.tmp / "model2"], "model2", setup=model_copy),
    Case("prune-output-is-file", lambda p: ["prune", p.model, *WANDA, "--calib", p.text, "-o", p.tmp / "file.txt"],
         "file.txt", setup=file_at),
    Case("prune-save-dense-is-output", lambda p: ["prune", p.model, *WANDA, "--calib", p.text, "-o", p.tmp / "o",
                                                  "--save-dense", p.tmp / "o"], "--save-dense"),
    Case("prune-output-is-calib", lambda p: ["prune", p.model, *WANDA, "--calib", p.tmp / "t.txt",
                                             "-o", p.tmp / "t.txt"], "t.txt",
         setup=lambda p: copy(p.text, p.tmp / "t.txt")),
    Case("prune-output-dot", lambda p: ["prune", p.model, *WANDA, "--calib", p.text, "-o", "."],
         ("-o", "already exists")),
    # ---- prune --resume
    Case("resume-nothing", lambda p: resume(p), "nothing to resume"),
    Case("resume-other-include", lambda p: resume(p, "--include", r"k_proj"), "target_names",
         setup=checkpoint_copy),
    Case("resume-other-lr", lambda p: resume(p, "--lr", "0.5"), "lr", setup=checkpoint_copy),
    Case("resume-past-steps", lambda p: resume(p, "--steps", "1"), ("past --steps 1",), setup=checkpoint_copy),
    Case("resume-state-truncated", lambda p: resume(p), ("checkpoint", "state.pt"),
         setup=lambda p: truncate(checkpoint_copy(p) / "state.pt")),
    Case("resume-state-text", lambda p: resume(p), ("checkpoint", "state.pt"),
         setup=lambda p: (checkpoint_copy(p) / "state.pt").write_text("hello")),
    Case("resume-state-no-identity", lambda p: resume(p), ("state.pt", "identity"),
         setup=lambda p: edit_state(p, lambda s: {"step": s["step"], "module": s["module"]})),
    Case("resume-state-not-a-dict", lambda p: resume(p), ("state.pt", "identity"),
         setup=lambda p: edit_state(p, lambda s: [1, 2, 3])),
    Case("resume-log-broken-middle", lambda p: resume(p), ("train_log.jsonl", "line 1"),
         setup=lambda p: (checkpoint_copy(p) / "train_log.jsonl").write_text('{"st\n{"step": 2}\n')),
    Case("prune-earlier-checkpoint", lambda p: ["prune", p.model, *LEARNED, "--calib", p.text,
                                                "--checkpoint-dir", p.tmp / "ck", "-o", p.tmp / "out"],
         ("holds a checkpoint", "--resume"), setup=checkpoint_copy),
    # ---- eval
    Case("eval-missing-ref", lambda p: ["eval", nonexistent(p), "--ppl", p.text], "does-not-exist"),
    Case("eval-device-bogus", lambda p: ["eval", p.art, "--ppl", p.text, "--device", "bogus"], "'bogus'"),
    Case("eval-device-cuda", lambda p: ["eval", p.art, "--ppl", p.text, "--device", "cuda"], "cuda"),
    Case("eval-seq-len", lambda p: ["eval", p.art, "--ppl", p.text, "--seq-len", "1"], "--seq-len 1"),
    Case("eval-stride", lambda p: ["eval", p.art, "--ppl", p.text, "--stride", "0"], "--stride 0"),
    Case("eval-limit-word", lambda p: ["eval", p.art, "--tasks", "piqa", "--limit", "some"], "'some'"),
    Case("eval-limit-fraction", lambda p: ["eval", p.art, "--tasks", "piqa", "--limit", "1.5"], "1.5"),
    Case("eval-limit-no-tasks", lambda p: ["eval", p.art, "--limit", "5"], "--tasks"),
    Case("eval-tasks-empty", lambda p: ["eval", p.art, "--tasks", "piqa,,boolq"], "piqa,,boolq"),
    Case("eval-include-path", lambda p: ["eval", p.art, "--tasks", "x", "--include-path", nonexistent(p)],
         "does-not-exist"),
    Case("eval-ppl-missing", lambda p: ["eval", p.art, "--ppl", nonexistent(p) / "t.txt"], "does-not-exist"),
    Case("eval-output-dir", lambda p: ["eval", p.art, "--ppl", p.text, "-o", p.tmp], "is a directory"),
    Case("eval-output-under-file", lambda p: ["eval", p.model, "--ppl", p.text, "--seq-len", "32",
                                              "-o", p.tmp / "file.txt" / "r.json"], "file.txt", setup=file_at),
    Case("eval-masks-nan", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text],
         ("mask of", "other than 0 and 1"), setup=lambda p: edit_masks(p, float_masks(float("nan")))),
    Case("eval-masks-two", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text],
         ("mask of", "other than 0 and 1"), setup=lambda p: edit_masks(p, float_masks(2.0))),
    Case("eval-masks-grid", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text], ("mask of", "grid"),
         setup=lambda p: edit_masks(p, lambda m: {**m, first(m): m[first(m)][:, :1].contiguous()})),
    Case("eval-masks-3d", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text], "mask of",
         setup=lambda p: edit_masks(p, lambda m: {**m, first(m): m[first(m)][None].contiguous()})),
    Case("eval-masks-missing-layer", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text], "different layers",
         setup=lambda p: edit_masks(p, lambda m: {n: t for n, t in m.items() if n != first(m)})),
    Case("eval-masks-truncated", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text], ("bad", "safetensors"),
         setup=lambda p: truncate(copy(p.art, p.tmp / "bad") / MASKS_FILE)),
    Case("eval-weights-shape", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text], ("weights.safetensors", "(3, 3)"),
         setup=lambda p: edit_masks(p, lambda m: {first(m): torch.zeros(3, 3)}, file=WEIGHTS_FILE)),
    Case("eval-weights-not-target", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text],
         ("weights.safetensors", "lm_head"),
         setup=lambda p: edit_masks(p, lambda m: {"lm_head": torch.zeros(3, 3)}, file=WEIGHTS_FILE)),
    Case("eval-fingerprint-empty", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text], "empty model_fingerprint",
         setup=lambda p: edit_manifest(p, lambda m: m.update(model_fingerprint=""))),
    Case("eval-fingerprint-off-stride", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text],
         ("fingerprint", "model2"),
         setup=lambda p: (model_copy(p, change_weights=off_stride_edit),
                          edit_manifest(p, lambda m: m.update(model=str(p.tmp / "model2"))))),
    Case("eval-manifest-number", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text], ("manifest", "int"),
         setup=lambda p: edit_manifest(p, lambda m: 42)),
    Case("eval-manifest-layer-sparsity-null", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text],
         ("layer_sparsity", "null"), setup=lambda p: edit_manifest(p, lambda m: m.update(layer_sparsity=None))),
    Case("eval-manifest-group-number", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text], ("group", "64"),
         setup=lambda p: edit_manifest(p, lambda m: m.update(group=64))),
    Case("eval-manifest-shape-word", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text], ("shape", "wide"),
         setup=lambda p: edit_manifest(p, lambda m: m["shapes"].update({first(m["shapes"]): "wide"}))),
    Case("eval-manifest-model-missing", lambda p: ["eval", p.tmp / "bad", "--ppl", p.text], "does-not-exist",
         setup=lambda p: edit_manifest(p, lambda m: m.update(model=str(nonexistent(p))))),
    Case("eval-lowered-truncated", lambda p: ["eval", p.tmp / "low", "--ppl", p.text], ("low", "safetensors"),
         setup=lambda p: bad_lowered(p, lambda d: truncate(d / "model.safetensors"))),
    Case("eval-lowered-layers-list", lambda p: ["eval", p.tmp / "low", "--ppl", p.text], ("low", "layers"),
         setup=lambda p: bad_lowered(p, lambda d: _quantization_edit(d, layers=[1, 2]))),
    Case("eval-lowered-config-broken", lambda p: ["eval", p.tmp / "low", "--ppl", p.text], "config.json",
         setup=lambda p: bad_lowered(p, lambda d: (d / "config.json").write_text('{"quantization_config": '))),
    Case("eval-lowered-pickle", lambda p: ["eval", p.tmp / "low", "--ppl", p.text], ("low", "pytorch_model.bin"),
         setup=lambda p: bad_lowered(p, lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"))),
    Case("eval-lowered-auto-map", lambda p: ["eval", p.tmp / "low", "--ppl", p.text], ("low", "auto_map"),
         setup=lambda p: bad_lowered(p, lambda d: _config_edit(
             d, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}))),
    Case("eval-lowered-layer-shape", lambda p: ["eval", p.tmp / "low", "--ppl", p.text], ("low", "layer"),
         setup=lambda p: bad_lowered(p, _lowered_shape_edit)),
    Case("eval-lowered-config-disagrees", lambda p: ["eval", p.tmp / "low", "--ppl", p.text], ("low", "config.json"),
         setup=lambda p: bad_lowered(p, lambda d: _config_edit(d, vocab_size=300))),
    # ---- report
    Case("report-missing", lambda p: ["report", nonexistent(p)], "does-not-exist"),
    Case("report-masks-truncated", lambda p: ["report", p.tmp / "bad", "-o", p.tmp / "r"], ("bad", "safetensors"),
         setup=lambda p: truncate(copy(p.art, p.tmp / "bad") / MASKS_FILE)),
    Case("report-masks-nan", lambda p: ["report", p.tmp / "bad", "-o", p.tmp / "r"], "other than 0 and 1",
         setup=lambda p: edit_masks(p, float_masks(float("nan")))),
    Case("report-manifest-number", lambda p: ["report", p.tmp / "bad", "-o", p.tmp / "r"], ("manifest", "int"),
         setup=lambda p: edit_manifest(p, lambda m: 7)),
    Case("report-layer-sparsity-null", lambda p: ["report", p.tmp / "bad", "-o", p.tmp / "r"],
         ("layer_sparsity", "null"), setup=lambda p: edit_manifest(p, lambda m: m.update(layer_sparsity=None))),
    Case("report-target-sparsity-word", lambda p: ["report", p.tmp / "bad", "-o", p.tmp / "r"],
         ("target_sparsity", "half"), setup=lambda p: edit_manifest(p, lambda m: m.update(target_sparsity="half"))),
    Case("report-output-under-file", lambda p: ["report", p.art, "-o", p.tmp / "file.txt" / "r"], "file.txt",
         setup=file_at),
    Case("report-output-is-artifact", lambda p: ["report", p.tmp / "a", "-o", p.tmp / "a"], "a",
         setup=lambda p: copy(p.art, p.tmp / "a")),
    # ---- lower
    Case("lower-missing", lambda p: ["lower", nonexistent(p), "-o", p.tmp / "o"], "does-not-exist"),
    Case("lower-backend", lambda p: ["lower", p.art, "--backend", "tensorrt", "-o", p.tmp / "o"], "tensorrt"),
    Case("lower-triton-no-gpu", lambda p: ["lower", p.art, "--backend", "triton", "-o", p.tmp / "o"], "triton"),
    Case("lower-standard-ops", lambda p: ["lower", p.art, "--onnx-standard-ops", "-o", p.tmp / "o"],
         "--onnx-standard-ops"),
    Case("lower-masks-truncated", lambda p: ["lower", p.tmp / "bad", "-o", p.tmp / "o"], ("bad", "safetensors"),
         setup=lambda p: truncate(copy(p.art, p.tmp / "bad") / MASKS_FILE)),
    Case("lower-fingerprint", lambda p: ["lower", p.tmp / "bad", "-o", p.tmp / "o"], "fingerprint",
         setup=lambda p: (model_copy(p, change_weights=off_stride_edit),
                          edit_manifest(p, lambda m: m.update(model=str(p.tmp / "model2"))))),
    Case("lower-output-under-file", lambda p: ["lower", p.art, "-o", p.tmp / "file.txt" / "o"], "file.txt",
         setup=file_at),
    Case("lower-output-is-artifact", lambda p: ["lower", p.tmp / "a", "-o", p.tmp / "a"], "a",
         setup=lambda p: copy(p.art, p.tmp / "a")),
    Case("lower-output-unrelated-dir", lambda p: ["lower", p.art, "-o", p.tmp / "mine"], "mine",
         setup=lambda p: (p.tmp / "mine").mkdir() or (p.tmp / "mine" / "notes.md").write_text("x")),
    # ---- reconstruct
    Case("reconstruct-output-is-artifact", lambda p: ["reconstruct", p.art, "--calib", p.text, "-o", p.art],
         "-o must differ"),
    Case("reconstruct-calib-missing", lambda p: ["reconstruct", p.art, "--calib", nonexistent(p) / "t.txt",
                                                 "-o", p.tmp / "o"], "does-not-exist"),
    Case("reconstruct-nsamples", lambda p: ["reconstruct", p.art, "--calib", p.text, "--nsamples", "0",
                                            "-o", p.tmp / "o"], "--nsamples 0"),
    Case("reconstruct-damp", lambda p: ["reconstruct", p.art, "--calib", p.text, "--damp", "-1", "-o", p.tmp / "o"],
         "--damp -1"),
    Case("reconstruct-refine", lambda p: ["reconstruct", p.art, "--calib", p.text, "--refine-steps", "-1",
                                          "-o", p.tmp / "o"], "--refine-steps -1"),
    Case("reconstruct-device", lambda p: ["reconstruct", p.art, "--calib", p.text, "--device", "gpu0",
                                          "-o", p.tmp / "o"], "'gpu0'"),
    Case("reconstruct-other-model", lambda p: ["reconstruct", p.art, "--calib", p.text, "--model", p.tmp / "model2",
                                               "-o", p.tmp / "o"], "fingerprint",
         setup=lambda p: model_copy(p, change_weights=off_stride_edit)),
    Case("reconstruct-masks-nan", lambda p: ["reconstruct", p.tmp / "bad", "--calib", p.text, "-o", p.tmp / "o"],
         "other than 0 and 1", setup=lambda p: edit_masks(p, float_masks(float("nan")))),
    Case("reconstruct-output-under-file", lambda p: ["reconstruct", p.art, "--calib", p.text, "--seq-len", "16",
                                                     "--nsamples", "2", "--quiet", "-o", p.tmp / "file.txt" / "o"],
         "file.txt", setup=file_at),
    Case("reconstruct-output-unrelated-dir", lambda p: ["reconstruct", p.art, "--calib", p.text, "--seq-len", "16",
                                                        "--nsamples", "2", "--quiet", "-o", p.tmp / "mine"], "mine",
         setup=lambda p: (p.tmp / "mine").mkdir() or (p.tmp / "mine" / "notes.md").write_text("x")),
]


def _lowered_shape_edit(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    layers = config["quantization_config"]["layers"]
    layers[first(layers)]["shape"] = [7, 7]
    (directory / "config.json").write_text(json.dumps(config))


def _quantization_edit(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _config_edit(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def snapshot(*roots: Path) -> dict:
    """Every path under ``roots``: a directory, or the sha256 of a file's bytes."""
    tree = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            tree[str(path)] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return tree


def test_corpus_size():
    assert len(CASES) >= 60 and len({case.id for case in CASES}) == len(CASES)
    commands = {case.args(SimpleNamespace(model=Path("m"), art=Path("a"), lowered=Path("l"), text=Path("t"),
                                          tmp=Path("x"), ckpt=Path("c")))[0] for case in CASES}
    assert commands == {"prune", "eval", "report", "lower", "reconstruct"}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input(case, shared, tmp_path, monkeypatch):
    p = SimpleNamespace(**vars(shared), tmp=tmp_path)
    monkeypatch.chdir(tmp_path)
    if case.setup:
        case.setup(p)
    if case.patch:
        case.patch(p, monkeypatch)
    args = case.args(p)
    before = snapshot(shared.root, tmp_path)

    result = invoke_gmc(*args)

    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    assert result.exit_code == case.code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("gmc: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    for expected in (case.expect,) if isinstance(case.expect, str) else case.expect:
        assert expected in errors[0], errors[0]
    after = snapshot(shared.root, tmp_path)
    changed = [path for path, digest in before.items() if after.get(path) != digest]
    assert not changed, f"changed or removed: {changed}"
    assert not [path for path in after if ".tmp-" in path or ".old-" in path], sorted(after)


# --------------------------------------------------------------------------- what must still succeed


def test_resume_drops_a_partial_last_log_line(shared, tmp_path):
    """A run killed while writing a log line resumes; the partial line is dropped, not parsed."""
    ckpt = copy(shared.ckpt, tmp_path / "ck")
    with open(ckpt / "train_log.jsonl", "a") as log:
        log.write('{"step": 4, "kd": 0.1')  # no newline: cut mid-write
    p = SimpleNamespace(**vars(shared), tmp=tmp_path)
    result = invoke_gmc(*resume(p))
    assert result.exit_code == 0, result.output
    steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_report_measures_sparsity_on_the_masks(shared, tmp_path):
    """A manifest whose sparsity disagrees with its masks is reported from the masks, with a warning."""
    p = SimpleNamespace(**vars(shared), tmp=tmp_path)
    bad = edit_manifest(p, lambda m: m["layer_sparsity"].update({n: 0.9 for n in m["layer_sparsity"]}))
    with pytest.warns(UserWarning, match="the manifest's sparsity"):
        result = invoke_gmc("report", bad, "-o", tmp_path / "r")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["sparsity_from"] == "masks" and abs(report["global_preserved"] - 0.5) < 0.01


def test_fingerprint_sees_every_value(tiny_llama):
    from gmc.formats.artifact import model_fingerprint

    before = model_fingerprint(tiny_llama)
    assert before == model_fingerprint(tiny_llama)
    weight = tiny_llama.model.layers[1].mlp.down_proj.weight
    for index in (1, 4097, weight.numel() - 1):  # off any sampling stride
        with torch.no_grad():
            weight.view(-1)[index] += 1e-6
        assert model_fingerprint(tiny_llama) != before
        before = model_fingerprint(tiny_llama)
