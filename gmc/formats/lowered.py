"""Lowered models: eager HF models whose target linears run ``gmc::group_sparse_linear``.

The graph pass ``gmc.graph.passes.lower_group_sparse`` lowers a traced graph; this module is its eager
twin, needed because ``model.generate`` with a KV cache runs the HF Python forward, not a graph:

- ``pack_model`` packs every masked target of an eager model (``gmc.kernels.packed``);
- ``swap_group_sparse_linears`` replaces those ``nn.Linear`` modules by ``GroupSparseLinear``;
- ``save_lowered`` / ``load_lowered`` write and rebuild a lowered model: an ordinary HF checkpoint
  whose targets are packed (``gmc.formats.hf_checkpoint`` has the format), beside the lowered
  program ``program.pt2`` (and ``compiled/``, ``gmc.formats.compiled``);
- ``gmc lower`` itself (the pipeline: trace -> lowering pass -> save) is ``gmc.runtime.lower``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

import torch
from torch import nn

from gmc.errors import GmcError
from gmc.groups import GroupSpec, Pattern, parse_pattern
from gmc.kernels.group_sparse_linear import group_sparse_linear
from gmc.kernels.packed import PackedLinear, pack

PROGRAM_FILE = "program.pt2"  # the lowered program (torch.export.save); gmc.runtime.lower writes it


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

    @classmethod
    def empty(cls, shape: tuple[int, int], spec: GroupSpec, groups: int, nnz: int, rows: int, dtype: torch.dtype,
              float_dtype: torch.dtype, bias: bool, device="meta") -> "GroupSparseLinear":
        """A layer of these packed sizes with uninitialised buffers: what a checkpoint loader builds
        before it assigns the stored tensors (then ``index_rows``). ``dtype``: of the values (int8 or
        float), ``float_dtype``: of the bias."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.out_features, module.in_features = shape
        module.spec = spec
        n_blocks = spec.grid(shape)[1]
        module.register_buffer("values", torch.empty(nnz, dtype=dtype, device=device))
        module.register_buffer("group_idx", torch.empty(groups, dtype=torch.int32, device=device))
        module.register_buffer("group_ptr", torch.empty(n_blocks + 1, dtype=torch.int32, device=device))
        module.register_buffer("row_idx", torch.empty(rows, dtype=torch.int64, device=device), persistent=False)
        module.register_buffer("row_ptr", torch.empty(n_blocks + 1, dtype=torch.int32, device=device),
                               persistent=False)
        module.register_buffer("bias", torch.empty(shape[0], dtype=float_dtype, device=device) if bias else None)
        int8 = dtype == torch.int8
        module.register_buffer("scales", torch.empty(rows, dtype=torch.float32, device=device) if int8 else None)
        return module

    def index_rows(self) -> None:
        """Rebuild ``row_idx``/``row_ptr`` (not stored) from ``group_idx``/``group_ptr``, checking them
        against the shape (``PackedLinear``)."""
        packed = self.packed()
        self.row_idx, self.row_ptr = packed.row_idx, packed.row_ptr

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


def save_lowered(
    directory: str | os.PathLike, model: nn.Module, tokenizer, packed: Mapping[str, PackedLinear], manifest: Mapping,
    program: Optional[torch.fx.GraphModule] = None,
) -> Path:
    """Write ``model`` with its targets ``packed`` as a packed HF checkpoint into ``directory``
    (``gmc.formats.hf_checkpoint``; ``manifest`` is saved as its provenance), the tokenizer beside it, and
    the lowered ``program`` (the graph ``lower_group_sparse`` produced) as ``program.pt2``.

    The targets of ``model`` are swapped for ``GroupSparseLinear`` in place: its dense target weights
    are dropped, so no second copy of the model is held while writing.
    """
    from gmc.formats.hf_checkpoint import attach_packed_config, refuse_without_gmc

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if program is not None:  # before the swap: the program may call modules it shares with model
        from gmc.graph.trace import export_logits

        vocab = int(getattr(model.config, "vocab_size", 2))
        torch.export.save(export_logits(program, vocab), directory / PROGRAM_FILE)
    swap_group_sparse_linears(model, packed)
    attach_packed_config(model, manifest)
    model.save_pretrained(directory)
    refuse_without_gmc(directory)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
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
    its config (``auto_map``) runs only with ``trust_remote_code``. It is
    ``AutoModelForCausalLM.from_pretrained(directory)`` after the checks of ``check_packed_checkpoint``,
    with its failures as one-line errors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gmc.formats.hf_checkpoint import check_packed_checkpoint

    directory = Path(directory)
    check_packed_checkpoint(directory, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=trust_remote_code,
                                                     local_files_only=True)
    except GmcError:
        raise
    except RuntimeError as error:  # transformers' report of weights whose shapes disagree with config.json
        raise GmcError(f"corrupted lowered model {directory}: its model.safetensors does not fit its config.json "
                       f"({_first_line(error)}); re-run `gmc lower`") from error
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise GmcError(f"corrupted lowered model {directory}: cannot load it ({_first_line(error)}); "
                       f"re-run `gmc lower`") from error
    model.to(device=device).eval()
    tokenizer = None
    if (directory / "tokenizer_config.json").is_file() or (directory / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    return model, tokenizer


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = next((line for line in lines if "size mismatch" in line or "safetensors" in line), None)
    return (detail or (lines[0] if lines else type(error).__name__))[:160]
