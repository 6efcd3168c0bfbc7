"""Lowered models: eager HF models whose target linears run ``gmc::group_sparse_linear``.

The graph pass ``gmc.passes.lower_group_sparse`` lowers a traced graph; this module is its eager
twin, needed because ``model.generate`` with a KV cache runs the HF Python forward, not a graph:

- ``pack_model`` packs every masked target of an eager model (``gmc.packed``);
- ``swap_group_sparse_linears`` replaces those ``nn.Linear`` modules by ``GroupSparseLinear``;
- ``save_lowered`` / ``load_lowered`` write and rebuild a lowered model: HF config, tokenizer,
  dense non-target weights and packed targets;
- ``gmc lower`` itself (the pipeline: trace -> lowering pass -> save) is ``gmc.lower``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

import torch
from torch import nn

from gmc.errors import GmcError
from gmc.groups import Pattern, parse_pattern
from gmc.kernels.group_sparse_linear import group_sparse_linear
from gmc.packed import PackedLinear, load_packed, pack, save_packed

TOKENIZER_DIR = "tokenizer"
PROGRAM_FILE = "program.pt2"  # the lowered program (torch.export.save); gmc.lower writes it


class GroupSparseLinear(nn.Module):
    """``nn.Linear`` replacement holding a PackedLinear's tensors as buffers; its forward is the op."""

    def __init__(self, packed: PackedLinear):
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self.spec = packed.spec
        self.register_buffer("values", packed.values)  # [nnz]
        self.register_buffer("group_idx", packed.group_idx)  # [n_kept_groups] int32
        self.register_buffer("group_ptr", packed.group_ptr)  # [G_in + 1] int32
        self.register_buffer("row_idx", packed.row_idx, persistent=False)  # [R] int64
        self.register_buffer("row_ptr", packed.row_ptr, persistent=False)  # [G_in + 1] int32
        self.register_buffer("bias", packed.bias)  # [d_out] or None
        self.register_buffer("scales", packed.scales)  # [R] fp32 for int8 values, else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d_in] -> [..., d_out]
        # eager CPU float32/bfloat16 goes from the dispatcher straight into the compiled kernel (no
        # Python between: gmc/kernels/group_sparse_linear.py); export, compile and ONNX see one op node
        return group_sparse_linear(x, self.values, self.row_idx, self.row_ptr, self.bias, self.out_features,
                                   self.spec.g_in, self.scales)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) converts floating buffers: int8 scales stay fp32 (the op's contract) and
        # only follow the device
        scales = self.scales
        super()._apply(fn, recurse)
        if scales is not None and self.scales.dtype != torch.float32:
            self.scales = scales.to(self.scales.device)
        return self

    def packed(self) -> PackedLinear:
        return PackedLinear(self.values, self.group_idx, self.group_ptr, (self.out_features, self.in_features),
                            self.spec, self.bias, self.scales)

    def extra_repr(self) -> str:
        kept = self.values.numel() / (self.out_features * self.in_features)
        int8 = ", int8" if self.scales is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.spec}, "
                f"kept={kept:.3f}{int8}")


def pack_model(
    model: nn.Module,
    masks: Mapping[str, torch.Tensor],
    pattern: Pattern,
    weights: Optional[Mapping[str, torch.Tensor]] = None,
) -> dict[str, PackedLinear]:
    """Pack the linears of ``model`` named in ``masks`` (``weights`` overrides their values)."""
    pattern = parse_pattern(pattern)
    modules = dict(model.named_modules())
    packed = {}
    for name, selectors in masks.items():
        module = modules.get(name)
        if not isinstance(module, nn.Linear):
            raise GmcError(f"masks name {name!r}, which is not an nn.Linear of {type(model).__name__}")
        weight = module.weight if weights is None or name not in weights else weights[name].to(module.weight)
        packed[name] = pack(weight, selectors, pattern, module.bias)
    return packed


def swap_group_sparse_linears(model: nn.Module, packed: Mapping[str, PackedLinear]) -> nn.Module:
    """Replace each ``nn.Linear`` named in ``packed`` by a ``GroupSparseLinear``, in place."""
    for name, layer in packed.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child, None)
        if not isinstance(old, (nn.Linear, GroupSparseLinear)):
            raise GmcError(f"cannot lower {name!r}: {type(model).__name__} has no linear of that name")
        if (old.out_features, old.in_features) != layer.shape:
            raise GmcError(f"cannot lower {name!r}: packed shape {layer.shape} != linear "
                           f"({old.out_features}, {old.in_features})")
        device = old.weight.device if isinstance(old, nn.Linear) else old.values.device
        if device.type != "meta":  # a model built under init_empty_weights keeps the packed device
            layer = layer.to(device)
        setattr(parent, child, GroupSparseLinear(layer))
    return model


def non_target_state(model: nn.Module, targets) -> dict[str, torch.Tensor]:
    """The model's state dict without target weights/biases and without tied duplicates."""
    skip = {f"{name}.{leaf}" for name in targets for leaf in ("weight", "bias")}
    state, seen = {}, set()
    for key, tensor in model.state_dict().items():
        if key in skip:
            continue
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ident in seen:  # tied (lm_head <- embed_tokens): restored by tie_weights on load
            continue
        seen.add(ident)
        state[key] = tensor
    return state


def save_lowered(
    directory: str | os.PathLike, model: nn.Module, tokenizer, packed: Mapping[str, PackedLinear], manifest: Mapping,
    program: Optional[torch.fx.GraphModule] = None,
) -> Path:
    """Write config, tokenizer, dense non-target weights and packed targets into ``directory``, and
    the lowered ``program`` (the graph ``lower_group_sparse`` produced) as ``program.pt2``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory / TOKENIZER_DIR)
    save_packed(directory, packed, non_target_state(model, packed), manifest)
    if program is not None:
        from gmc.trace import export_logits

        vocab = int(getattr(model.config, "vocab_size", 2))
        torch.export.save(export_logits(program, vocab), directory / PROGRAM_FILE)
    return directory


def load_program(directory: str | os.PathLike) -> torch.export.ExportedProgram:
    """The lowered program of a ``gmc lower`` directory: ``input_ids [B, S] -> logits``.

    A pt2 archive may hold pickled tensors or objects, which ``torch.export.load`` unpickles with
    ``weights_only=False``: the archive's payload configs are read first and anything but raw
    tensor bytes is refused, so loading it runs no code.
    """
    path = Path(directory) / PROGRAM_FILE
    if not path.is_file():
        raise GmcError(f"{directory} has no {PROGRAM_FILE}: lower it again with a current `gmc lower`")
    _check_raw_payloads(path)
    try:
        return torch.export.load(path)
    except Exception as error:  # the loader raises many types; one line names the file
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise GmcError(f"corrupted lowered program {path}: {first}; re-run `gmc lower`") from error


def _check_raw_payloads(path: Path) -> None:
    """Refuse an archive entry that ``torch.export.load`` would unpickle with code execution allowed:
    payloads flagged ``use_pickle`` (loaded ``weights_only=False``), custom objects, and ``.pt``
    entries (sample inputs) that do not load with ``weights_only=True`` (the loader falls back)."""
    import io
    import json
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                leaf = name.rsplit("/", 1)[-1]
                if leaf.startswith(("custom_obj", "opaque_obj")):
                    raise GmcError(f"lowered program {path} holds a pickled object {name}: refused (it could run code)")
                if leaf.endswith(".pt"):
                    try:
                        torch.load(io.BytesIO(archive.read(name)), weights_only=True)
                    except Exception as error:
                        raise GmcError(f"lowered program {path} holds {name}, which is not plain tensor data: "
                                       f"refused (it could run code)") from error
                elif leaf.endswith("_config.json"):  # weights/constants payload configs
                    entries = json.loads(archive.read(name)).get("config", {})
                    if any(entry.get("use_pickle") for entry in entries.values()):
                        raise GmcError(f"lowered program {path} holds pickled payloads ({name}): refused "
                                       f"(they could run code)")
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise GmcError(f"corrupted lowered program {path}: {error}; re-run `gmc lower`") from error


def load_lowered(directory: str | os.PathLike, device: str = "cpu", trust_remote_code: bool = False):
    """Rebuild a lowered model from ``directory``: ``(model, tokenizer)``; generate works. Code named by
    its config (``auto_map``) runs only with ``trust_remote_code``."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    packed, dense, _ = load_packed(directory)
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
        with init_empty_weights(include_buffers=False):  # parameters on meta: no random init
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise GmcError(f"corrupted lowered model {directory}: cannot build its model from config.json "
                       f"({str(error).strip()[:120]}); re-run `gmc lower`") from error
    dtype = next(iter(dense.values())).dtype if dense else torch.float32
    swap_group_sparse_linears(model, packed)
    try:
        model.load_state_dict(dense, strict=False, assign=True)
    except RuntimeError as error:  # shapes of model.safetensors disagree with config.json
        raise GmcError(f"corrupted lowered model {directory}: its weights do not fit its config.json "
                       f"({str(error).strip().splitlines()[-1].strip()[:120]}); re-run `gmc lower`") from error
    model.tie_weights()
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise GmcError(f"lowered model {directory} lacks weights for {', '.join(left[:3])}")
    model.to(device=device, dtype=dtype).eval()
    tokenizer = None
    if (directory / TOKENIZER_DIR).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(directory / TOKENIZER_DIR, trust_remote_code=trust_remote_code)
    return model, tokenizer
