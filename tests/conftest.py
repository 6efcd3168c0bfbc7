"""Shared fixtures: tiny random causal LMs built from configs (no download) and the bundled model."""
from __future__ import annotations

import pytest
import torch

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random ``*ForCausalLM`` of ``arch`` (llama, qwen3, qwen2, mistral) in eval mode."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


class CharTokenizer:
    """A stand-in HF tokenizer for tiny models: bytes -> ids, BOS = 1."""

    bos_token_id = 1
    eos_token_id = 2
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True, **_):
        ids = [3 + b for b in text.encode("utf-8")][:10_000]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture
def char_tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M (slow tests only)."""
    from gmc.model import load_model

    return load_model("smollm2-135m")


def _byte_bpe_tokenizer(vocab_size: int = 300):
    """A real HF fast tokenizer trained offline on the bundled calibration text."""
    import tokenizers
    import transformers

    from gmc.calib import BUNDLED

    lines = BUNDLED["bundled"].read_text().splitlines()[:300]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<s>", "</s>", "<pad>"], show_progress=False)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a real tokenizer saved as an HF directory (for CLI tests).

    hidden 128 and intermediate 320 make 1x256 groups ragged (320 = 256 + 64)."""
    path = tmp_path_factory.mktemp("tiny") / "llama"
    tiny_model("llama", hidden_size=128, intermediate_size=320).save_pretrained(path)
    _byte_bpe_tokenizer().save_pretrained(path)
    return path


def wait_for_checkpoint(path, proc, min_step: int, timeout: float = 300) -> None:
    """Poll a learner checkpoint until it records ``min_step`` (for kill-and-resume tests)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists():
            try:
                if torch.load(path, weights_only=True)["step"] >= min_step:
                    return
            except Exception:
                pass  # being replaced right now; the atomic rename makes the next read whole
        time.sleep(0.2)
    raise AssertionError("no checkpoint appeared")
