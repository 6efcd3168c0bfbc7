"""Builders shared by the eval and report tests: a tiny model saved with a real tokenizer, a
hand-made masks artifact for it, a local lm-eval multiple-choice task over JSONL, and artifact
manifests with known per-layer rates."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_model

SMOL_VOCAB = 49152  # SmolLM2's vocabulary, so its tokenizer drives the tiny model


@functools.lru_cache(maxsize=1)
def smol_tokenizer():
    """The bundled SmolLM2 tokenizer (offline); skips the test if the model is not installed."""
    from transformers import AutoTokenizer

    from gmc.errors import GmcError
    from gmc.model import _smollm2_hf_dir

    try:
        return AutoTokenizer.from_pretrained(str(_smollm2_hf_dir()))
    except GmcError as error:
        pytest.skip(f"bundled SmolLM2 unavailable: {error}")


def tiny_smol_model(seed: int = 0) -> torch.nn.Module:
    """A 1-layer random Llama with SmolLM2's vocabulary (about 3M parameters)."""
    return tiny_model("llama", seed=seed, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=SMOL_VOCAB)


def save_checkpoint(path: Path, seed: int = 0) -> Path:
    model = tiny_smol_model(seed)
    model.save_pretrained(path)
    smol_tokenizer().save_pretrained(path)
    return path


def make_artifact(path: Path, model_ref: str, model: torch.nn.Module, keep: float, seed: int = 0) -> Path:
    """A 1x16 masks artifact over every attention/MLP projection keeping about ``keep`` of groups."""
    from gmc.artifact import MaskArtifact, build_manifest, save_artifact
    from gmc.groups import parse_pattern
    from gmc.model import model_fingerprint

    pattern = parse_pattern("1x16")
    generator = torch.Generator().manual_seed(seed)
    shapes, masks = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
            shapes[name] = tuple(module.weight.shape)
            masks[name] = torch.rand(pattern.grid(shapes[name]), generator=generator) < keep
    manifest = build_manifest(
        model_ref=model_ref, fingerprint=model_fingerprint(model), pattern=pattern, masks=masks,
        shapes=shapes, method="hand", allocation="uniform", target_sparsity=1 - keep,
        calibration="none", seed=seed,
    )
    return save_artifact(path, MaskArtifact(masks, manifest))


def write_text(path: Path, paragraphs: int = 40) -> Path:
    lines = [f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13} times."
             for i in range(paragraphs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_mc_task(directory: Path, name: str = "gmc_test_mc", docs: int = 8,
                  metrics: tuple[str, ...] = ("acc",)) -> Path:
    """A local multiple-choice lm-eval task (YAML + JSONL) in ``directory``; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{name}.jsonl"
    rows = [{"question": f"Is {i} an even number?", "choices": ["yes", "no"], "label": i % 2} for i in range(docs)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    metric_list = "".join(
        f"  - metric: {metric}\n    aggregation: mean\n    higher_is_better: true\n" for metric in metrics
    )
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "output_type: multiple_choice\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        f"metric_list:\n{metric_list}"
    )
    return directory


# report: 4 layers x 7 projections with hand-chosen preserved rates
SHAPES = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64),
          "gate": (128, 64), "up": (128, 64), "down": (64, 128)}
LAYERS = 4


def name(layer: int, proj: str) -> str:
    block = "self_attn" if proj in ("q", "k", "v", "o") else "mlp"
    return f"model.layers.{layer}.{block}.{proj}_proj"


def write_manifest(path, rate, target_sparsity=0.5, with_shapes=True):
    """An artifact directory whose target (layer, proj) keeps ``rate(layer, proj)`` of its weights."""
    path.mkdir(parents=True, exist_ok=True)
    names = {name(layer, proj): (layer, proj) for layer in range(LAYERS) for proj in SHAPES}
    manifest = {
        "gmc_version": "0.1.0", "model": "hand-made", "model_fingerprint": "0" * 16, "group": "1x16",
        "method": "hand", "allocation": "adaptive", "target_sparsity": target_sparsity,
        "global_sparsity": None, "calibration": "none", "seed": 0,
        "layer_sparsity": {n: 1 - rate(*lp) for n, lp in names.items()},
    }
    if with_shapes:
        manifest["shapes"] = {n: list(SHAPES[proj]) for n, (_, proj) in names.items()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def correlated(layer, proj):
    """Q and K perfectly correlated (k = 2q - 0.2), gate and up perfectly anti-correlated."""
    q = 0.3 + 0.1 * layer
    return {"q": q, "k": 2 * q - 0.2, "v": 0.5, "o": 0.25 + 0.05 * layer,
            "gate": 0.5 + 0.05 * layer, "up": 0.8 - 0.05 * layer, "down": 0.75}[proj]


def additive(layer, proj):
    """rate = type effect + depth effect, no interaction."""
    return 0.1 * (list(SHAPES).index(proj) + 1) + 0.05 * layer
