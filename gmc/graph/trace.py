"""Trace a causal LM into an FX GraphModule with ``torch.export``.

The graph computes ``input_ids [B, S] -> logits [B, S, V]`` with dynamic batch and sequence
length, traced non-strict (the HF forward is ordinary Python). Parameters are ``get_attr`` nodes
that share storage with the eager model, named ``model.<HF parameter name>``: ``hf_name`` turns
such a target back into the HF module name that masks are keyed by.

Exports record no Python stack trace per node (``torch.fx.config.do_not_emit_stack_traces``): no
pass reads them, and collecting them took about a third of SmolLM2's export time.

``ExportedProgram.module()`` refuses ``.train()``; these models have no active dropout at
inference settings, and gradients flow through the graph regardless (docs/design.md section 10).
"""
from __future__ import annotations

import torch
import torch.fx.config

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


def attr_tensor(gm: torch.nn.Module, target: str) -> torch.Tensor:
    """The parameter or buffer a ``get_attr`` node names."""
    try:
        return gm.get_parameter(target)
    except AttributeError:
        return gm.get_buffer(target)


def drop_if_unused(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Erase a ``get_attr`` node nothing uses, and the graph's reference to its tensor."""
    if node.users:
        return
    gm.graph.erase_node(node)
    if any(other.op == "get_attr" and other.target == node.target for other in gm.graph.nodes):
        return  # another node still reads the attribute
    owner_name, _, leaf = node.target.rpartition(".")
    owner = gm.get_submodule(owner_name)
    if hasattr(owner, leaf):
        delattr(owner, leaf)


def linear_nodes(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    """``aten.linear`` nodes whose weight is a ``get_attr``, keyed by HF module name, in execution order."""
    found = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        weight = node.args[1]
        if isinstance(weight, torch.fx.Node) and weight.op == "get_attr":
            found[hf_name(weight.target).removesuffix(".weight")] = node
    return found


def trace_model(model: torch.nn.Module, example_seq_len: int = 16) -> torch.fx.GraphModule:
    """Export ``model`` (a HF *ForCausalLM) to a GraphModule with frozen parameters."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    vocab = int(getattr(model.config, "vocab_size", 2))
    try:
        program = export_logits(LogitsOnly(model), vocab, example_seq_len)
    except Exception as error:  # export raises many types; the user needs the class and first line
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise GmcError(f"cannot trace {type(model).__name__} with torch.export: {first}") from error
    gm = program.module()
    _drop_dtype_asserts(gm)
    gm.meta["gmc_model_class"] = type(model).__name__
    return gm


def _drop_dtype_asserts(gm: torch.fx.GraphModule) -> None:
    """Remove export's checks of the dtypes seen while tracing (``aten._assert_tensor_metadata``
    before each cast): the learner runs this graph under bf16 autocast, where the activations
    those checks name are legitimately bf16 (on CUDA they raised "Tensor dtype mismatch")."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()


def length_dim(name: str, max_len: int, device) -> torch.export.Dim:
    """The dynamic sequence length of an export on ``device`` (from 2: sizes 0 and 1 specialise).

    On CUDA, SDPA's fused kernels state shape rules over the length (the memory-efficient kernel
    pads its mask to a multiple of 8) that export's solver cannot prove for a named dimension, and
    it rejects the export; there the length is ``Dim.DYNAMIC``, which keeps such rules as runtime
    checks. CPU exports keep the named dimension."""
    if torch.device(device).type == "cuda":
        return torch.export.Dim.DYNAMIC(min=2, max=max_len)
    return torch.export.Dim(name, min=2, max=max_len)


def export_logits(module: torch.nn.Module, vocab: int, example_seq_len: int = 16) -> torch.export.ExportedProgram:
    """``torch.export`` of an ``input_ids [B, S] -> logits`` module with dynamic batch and length:
    the first export of a model, and the re-export of a graph after passes (``gmc lower``)."""
    device = next(iter(module.parameters()), torch.empty(0)).device
    example = torch.randint(0, vocab, (2, example_seq_len), device=device)  # sizes 0 and 1 would specialise
    dynamic = {
        "input_ids": {
            0: torch.export.Dim("batch", min=1, max=4096),
            1: length_dim("seq", MAX_SEQ_LEN, device),
        }
    }
    return export(module, (example,), dynamic)


def export(module: torch.nn.Module, args: tuple, dynamic_shapes) -> torch.export.ExportedProgram:
    """Every gmc export: non-strict, without gradients, without per-node stack traces."""
    saved = getattr(torch.fx.config, "do_not_emit_stack_traces", None)  # None: a torch without the flag
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        with torch.no_grad():
            return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        if saved is None:
            del torch.fx.config.do_not_emit_stack_traces
        else:
            torch.fx.config.do_not_emit_stack_traces = saved
