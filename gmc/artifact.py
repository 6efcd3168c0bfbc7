"""The masks artifact: a directory with binary selectors and a manifest.

Layout::

    masks.safetensors   one bool tensor per target, keyed by module name, shape = pattern grid
    manifest.json       provenance and achieved sparsity (keys listed in MANIFEST_KEYS)
    weights.safetensors optional: updated target weights (SparseGPT reconstruction)

Every directory gmc writes goes through ``atomic_dir``: it is built under a temporary name next
to its destination and renamed into place only when complete, so a crash never leaves a
half-written artifact behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gmc import __version__
from gmc.errors import GmcError
from gmc.groups import Pattern, global_sparsity, layer_sparsity, parse_pattern

MASKS_FILE = "masks.safetensors"
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"
MANIFEST_KEYS = (
    "gmc_version", "model", "model_fingerprint", "group", "method", "allocation",
    "target_sparsity", "global_sparsity", "layer_sparsity", "calibration", "seed",
)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success replace ``path`` with it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a file through a temp file + rename in the same directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@dataclass
class MaskArtifact:
    """Binary selectors for every target plus the manifest that says where they came from."""

    masks: dict[str, torch.Tensor]  # module name -> bool [G_out, G_in]
    manifest: dict
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # module name -> updated weight

    @property
    def pattern(self) -> Pattern:
        return parse_pattern(self.manifest["group"])

    def check_matches(self, model: torch.nn.Module, fingerprint: str | None = None) -> None:
        """Refuse a model whose target names or shapes (or fingerprint) differ from the masks."""
        modules = dict(model.named_modules())
        pattern = self.pattern
        for name, selectors in self.masks.items():
            module = modules.get(name)
            if module is None or not hasattr(module, "weight"):
                raise GmcError(f"masks do not match the model: it has no linear named {name!r}")
            shape = tuple(module.weight.shape)
            if tuple(selectors.shape) != pattern.grid(shape):
                raise GmcError(
                    f"masks do not match the model: {name} has weight {shape}, whose "
                    f"{pattern} grid is {pattern.grid(shape)}, but its mask is {tuple(selectors.shape)}"
                )
        expected = self.manifest.get("model_fingerprint")
        if fingerprint is not None and expected and fingerprint != expected:
            raise GmcError(
                f"masks do not match the model: its fingerprint is {fingerprint}, the masks were "
                f"learned on {expected} ({self.manifest.get('model')})"
            )

    @torch.no_grad()
    def apply_to(self, model: torch.nn.Module, check_fingerprint: bool = True) -> torch.nn.Module:
        """Fold the masks (and updated weights, if any) into an eager model's linears, in place."""
        from gmc.model import model_fingerprint

        self.check_matches(model, model_fingerprint(model) if check_fingerprint else None)
        modules = dict(model.named_modules())
        pattern = self.pattern
        for name, selectors in self.masks.items():
            weight = modules[name].weight
            if name in self.weights:
                weight.copy_(self.weights[name].to(weight.dtype))
            mask = pattern.expand(selectors.to(weight.device), tuple(weight.shape))
            weight.mul_(mask.to(weight.dtype))
        return model


def build_manifest(
    *, model_ref: str, fingerprint: str, pattern: Pattern, masks: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, int]], method: str, allocation: str, target_sparsity: float,
    calibration: str, seed: int, **extra,
) -> dict:
    """The manifest of DESIGN.md / issue 2, with achieved sparsity computed from the masks."""
    manifest = {
        "gmc_version": __version__,
        "model": model_ref,
        "model_fingerprint": fingerprint,
        "group": str(pattern),
        "method": method,
        "allocation": allocation,
        "target_sparsity": target_sparsity,
        "global_sparsity": global_sparsity(pattern, masks, shapes),
        "layer_sparsity": {n: layer_sparsity(pattern, masks[n], shapes[n]) for n in masks},
        "shapes": {n: list(shapes[n]) for n in masks},
        "calibration": calibration,
        "seed": seed,
    }
    manifest.update(extra)
    return manifest


def save_artifact(path: str | os.PathLike, artifact: MaskArtifact, extra_files=()) -> Path:
    """Write the artifact directory atomically. ``extra_files``: (name, bytes) pairs."""
    with atomic_dir(path) as tmp:
        save_file({n: m.bool().contiguous().cpu() for n, m in artifact.masks.items()}, tmp / MASKS_FILE)
        if artifact.weights:
            save_file({n: w.contiguous().cpu() for n, w in artifact.weights.items()}, tmp / WEIGHTS_FILE)
            artifact.manifest["weights_updated"] = True
        (tmp / MANIFEST_FILE).write_text(json.dumps(artifact.manifest, indent=2) + "\n")
        for name, data in extra_files:
            (tmp / name).write_bytes(data)
    return Path(path)


def load_artifact(path: str | os.PathLike) -> MaskArtifact:
    """Read and validate an artifact directory; a missing or corrupted one is a GmcError."""
    path = Path(path)
    if not path.is_dir():
        raise GmcError(f"masks artifact not found: {path} is not a directory")
    for name in (MASKS_FILE, MANIFEST_FILE):
        if not (path / name).is_file():
            raise GmcError(f"{path} is not a gmc masks artifact: {name} is missing")
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise GmcError(f"corrupted artifact {path}: {MANIFEST_FILE} is not valid JSON ({error})") from error
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    if missing:
        raise GmcError(f"corrupted artifact {path}: manifest lacks {', '.join(missing)}")
    try:
        masks = load_file(path / MASKS_FILE)
        weights = load_file(path / WEIGHTS_FILE) if (path / WEIGHTS_FILE).is_file() else {}
    except (SafetensorError, OSError, RuntimeError) as error:
        raise GmcError(f"corrupted artifact {path}: cannot read safetensors ({error})") from error
    if set(masks) != set(manifest["layer_sparsity"]):
        raise GmcError(f"corrupted artifact {path}: masks and manifest name different layers")
    parse_pattern(manifest["group"])
    return MaskArtifact({n: m.bool() for n, m in masks.items()}, manifest, weights)
