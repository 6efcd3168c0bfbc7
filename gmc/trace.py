"""Trace a causal LM into an FX GraphModule with ``torch.export``.

The graph computes ``input_ids [B, S] -> logits [B, S, V]`` with dynamic batch and sequence
length, traced non-strict (the HF forward is ordinary Python). Parameters are ``get_attr`` nodes
that share storage with the eager model, named ``model.<HF parameter name>``: ``hf_name`` turns
such a target back into the HF module name that masks are keyed by.

``ExportedProgram.module()`` refuses ``.train()``; these models have no active dropout at
inference settings, and gradients flow through the graph regardless (DESIGN.md section 10).
"""
from __future__ import annotations

import torch

from gmc.errors import GmcError

_PREFIX = "model."
MAX_SEQ_LEN = 1 << 17


class LogitsOnly(torch.nn.Module):
    """``input_ids -> logits`` without KV cache: the signature every gmc graph has."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def hf_name(attr_target: str) -> str:
    """``model.model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj.weight``."""
    return attr_target[len(_PREFIX):] if attr_target.startswith(_PREFIX) else attr_target


def trace_model(model: torch.nn.Module, example_seq_len: int = 16) -> torch.fx.GraphModule:
    """Export ``model`` (a HF *ForCausalLM) to a GraphModule with frozen parameters."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    device = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 2))
    example = torch.randint(0, vocab, (2, example_seq_len), device=device)
    dynamic = {
        "input_ids": {
            0: torch.export.Dim("batch", min=1, max=4096),
            1: torch.export.Dim("seq", min=2, max=MAX_SEQ_LEN),
        }
    }
    try:
        with torch.no_grad():
            program = torch.export.export(LogitsOnly(model), (example,), dynamic_shapes=dynamic, strict=False)
    except Exception as error:  # export raises many types; the user needs the class and first line
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise GmcError(f"cannot trace {type(model).__name__} with torch.export: {first}") from error
    gm = program.module()
    gm.meta["gmc_model_class"] = type(model).__name__
    return gm
