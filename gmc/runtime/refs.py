"""Model references: what ``gmc eval`` and ``gmc generate`` take, resolved and loaded.

A reference is a model (``smollm2-135m``, hub id, .gguf, HF directory), a masks artifact (its base
model is loaded and the masks folded in), or a lowered directory. ``resolve_ref`` classifies one
without loading anything, so a bad path fails before a corpus or a model is read;
``prepared_models`` loads them in order. Artifacts that share a base model reuse one loaded copy:
the masked weights are backed up on the CPU and restored after each artifact.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from gmc.errors import GmcError
from gmc.formats.artifact import MANIFEST_FILE, MASKS_FILE
from gmc.inputs.model import SMOLLM2_ALIAS


@dataclass
class ModelRef:
    """What a reference names, resolved without loading anything."""

    ref: str
    kind: str  # "dense" (model ref or HF dir), "masks" (artifact), "lowered"
    base: str  # the model ref to load: the ref itself, or a masks artifact's manifest "model"


def resolve_ref(ref: str, model: str | None = None) -> ModelRef:
    """Classify ``ref``; a path that cannot be a model is a GmcError here, before any loading.
    ``model``: the base of a masks artifact instead of the one its manifest names (``--model``)."""
    from gmc.formats.hf_checkpoint import packed_config

    path = Path(ref).expanduser()
    if path.is_dir():
        if (path / MANIFEST_FILE).is_file() and (path / MASKS_FILE).is_file():
            manifest = _read_json(path / MANIFEST_FILE)
            if not isinstance(manifest, dict):
                raise GmcError(f"corrupted artifact {ref}: manifest.json holds a JSON {type(manifest).__name__}, "
                               f"not an object")
            if "model" not in manifest:
                raise GmcError(f"corrupted artifact {ref}: manifest.json has no 'model'")
            return ModelRef(ref, "masks", _canonical(model or str(manifest["model"])))
        if packed_config(path) is not None:
            return ModelRef(ref, "lowered", ref)
        if (path / "config.json").is_file():
            return ModelRef(ref, "dense", _canonical(ref))
        raise GmcError(
            f"{ref} is a directory but not a model: expected a HF checkpoint (config.json), a gmc "
            f"masks artifact (manifest.json + masks.safetensors) or a lowered model (gmc lower)"
        )
    looks_local = ref.startswith((".", "/", "~")) or (len(path.parts) > 1 and path.parent.is_dir())
    if path.exists() or ref == SMOLLM2_ALIAS or path.suffix == ".gguf" or not looks_local:
        return ModelRef(ref, "dense", ref)
    raise GmcError(f"model or artifact not found: {ref} (no such directory)")


def _canonical(ref: str) -> str:
    """A local model directory as an absolute path, so two spellings share one loaded base."""
    path = Path(ref).expanduser()
    return str(path.resolve()) if path.is_dir() else ref


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise GmcError(f"{path} is not valid JSON ({error})") from error


@dataclass
class PreparedModel:
    """A model ready to evaluate plus what the results must record about it."""

    model: torch.nn.Module
    tokenizer: object
    target: ModelRef
    fingerprint: str  # of the weights as evaluated (after masks)
    info: dict  # kind-specific provenance: base fingerprint, group, method, sparsity


class _BaseModels:
    """Loads each base model once and frees it after its last user (see ``_masked`` for restores)."""

    def __init__(self, targets: list[ModelRef], dtype: str, device: str, trust_remote_code: bool = False):
        self.trust_remote_code = trust_remote_code
        self.uses = {}
        for target in targets:
            if target.kind != "lowered":
                self.uses[target.base] = self.uses.get(target.base, 0) + 1
        self.loaded = {}
        self.dtype, self.device = dtype, device

    def take(self, base: str):
        from gmc.inputs.model import load_model

        if base not in self.loaded:
            self.loaded[base] = load_model(base, dtype=self.dtype, device=self.device,
                                           trust_remote_code=self.trust_remote_code)
        self.uses[base] -= 1
        loaded = self.loaded[base]
        if self.uses[base] == 0:
            del self.loaded[base]  # last user: free it once the caller drops it
        return loaded, self.uses[base] > 0


def prepared_models(refs: list[str], dtype: str, device: str, model: str | None,
                    trust_remote_code: bool) -> Iterator[PreparedModel]:
    """Yield a ``PreparedModel`` per ref, in order; a shared base model is loaded once. ``model``:
    the base of every masks artifact instead of the one its manifest names (``--model``)."""
    targets = [resolve_ref(ref, model) for ref in refs]
    bases = _BaseModels(targets, dtype, device, trust_remote_code)
    for target in targets:
        if target.kind == "lowered":
            yield _load_lowered(target, device, trust_remote_code)
        elif target.kind == "masks":
            yield from _masked(target, bases)
        else:
            loaded, _ = bases.take(target.base)
            yield PreparedModel(loaded.model, loaded.tokenizer, target, _fingerprint(loaded.model),
                            {"zero_fraction": linear_zero_fraction(loaded.model)})


def _masked(target: ModelRef, bases: _BaseModels) -> Iterator[PreparedModel]:
    from gmc.formats.artifact import load_artifact

    artifact = load_artifact(target.ref)
    loaded, reused = bases.take(target.base)
    modules = dict(loaded.model.named_modules())
    backup = {name: modules[name].weight.detach().to("cpu", copy=True)
              for name in artifact.masks if reused and name in modules}
    artifact.apply_to(loaded.model)
    manifest = artifact.manifest
    info = {key: manifest.get(key) for key in
            ("model", "model_fingerprint", "group", "method", "allocation", "target_sparsity",
             "global_sparsity", "calibration")}
    info["zero_fraction"] = linear_zero_fraction(loaded.model)
    try:
        yield PreparedModel(loaded.model, loaded.tokenizer, target, _fingerprint(loaded.model), info)
    finally:
        with torch.no_grad():
            for name, weight in backup.items():
                modules[name].weight.copy_(weight)


def _load_lowered(target: ModelRef, device: str, trust_remote_code: bool = False) -> PreparedModel:
    from gmc.formats.lowered import load_lowered

    model, tokenizer = load_lowered(target.ref, device=device, trust_remote_code=trust_remote_code)
    if tokenizer is None:
        raise GmcError(f"lowered model {target.ref} has no tokenizer; re-run `gmc lower` on its artifact")
    info = model.config.quantization_config.provenance
    keys = ("model", "group", "method", "global_sparsity", "backend", "source_artifact")
    keep = {key: info.get(key) for key in keys}
    return PreparedModel(model, tokenizer, target, _fingerprint(model), keep)


def _fingerprint(model) -> str:
    from gmc.formats.artifact import model_fingerprint

    return model_fingerprint(model)


@torch.no_grad()
def linear_zero_fraction(model: torch.nn.Module) -> float:
    """Fraction of exactly-zero weights over the decoder's ``nn.Linear`` layers (not ``lm_head``)."""
    zeros = total = 0
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not output:
            zeros += int((module.weight == 0).sum())
            total += module.weight.numel()
    return zeros / total if total else 0.0
