"""Lowered models: eager HF models whose target linears run ``gmc::group_sparse_linear``.

The graph pass ``gmc.passes.lower_group_sparse`` lowers a traced graph; this module is its eager
twin, needed because ``model.generate`` with a KV cache runs the HF Python forward, not a graph:

- ``pack_model`` packs every masked target of an eager model (``gmc.packed``);
- ``swap_group_sparse_linears`` replaces those ``nn.Linear`` modules by ``GroupSparseLinear``;
- ``save_lowered`` / ``load_lowered`` write and rebuild a lowered model: HF config, tokenizer,
  dense non-target weights and packed targets;
- ``lower_artifact`` is what ``gmc lower`` runs: masks artifact -> packed directory or ONNX file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch
from torch import nn

from gmc.errors import GmcError
from gmc.groups import NMSpec, Pattern, parse_pattern
from gmc.kernels import cpu_group_sparse
from gmc.kernels.group_sparse_linear import group_sparse_linear, group_sparse_linear_cpu, rows_ascending
from gmc.outputs import check_output, output_path
from gmc.packed import PackedLinear, load_packed, pack, save_packed

BACKENDS = ("torch", "triton", "onnx")
TOKENIZER_DIR = "tokenizer"


class GroupSparseLinear(nn.Module):
    """``nn.Linear`` replacement holding a PackedLinear's tensors as buffers."""

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
        ptr, widths = packed.row_ptr.tolist(), _widths(packed)
        # (row_start, n_rows, width) per input block, static: the ONNX standard-op decomposition
        self.blocks = [(ptr[v], ptr[v + 1] - ptr[v], w) for v, w in enumerate(widths)]
        self.onnx_standard_ops = False
        self.rows_ascending = rows_ascending(packed.row_idx, packed.row_ptr)  # lets the CPU kernel skip the check

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d_in] -> [..., d_out]
        if x.dtype == torch.float32 and x.device.type == "cpu" and self.rows_ascending and x.shape[-1] == self.in_features \
                and not torch.compiler.is_compiling() and not torch.onnx.is_in_onnx_export():
            kernel = cpu_group_sparse.kernel()
            if kernel is not None:
                # eager decode fast path: straight into the compiled kernel, which checks the
                # packed tensors itself (group_sparse_linear_cpu's Python checks cost ~10 us)
                out = kernel.forward(x.reshape(-1, self.in_features).contiguous(), self.values, self.row_idx,
                                     self.row_ptr, self.bias, self.out_features, self.spec.g_in, 0)
                return out.view(*x.shape[:-1], self.out_features)
        if torch.onnx.is_in_onnx_export():
            from gmc.kernels.onnx_group_sparse import onnx_group_sparse_linear

            return onnx_group_sparse_linear(
                x, self.values, self.row_idx, self.row_ptr, self.bias, self.out_features,
                self.spec.g_in, self.blocks, self.onnx_standard_ops,
            )
        args = (x, self.values, self.row_idx, self.row_ptr, self.bias, self.out_features, self.spec.g_in)
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            # eager CPU: the op's own implementation without the dispatcher round trip (~20 us
            # per call, visible on SmolLM2's small projections); export and compile see the op
            return group_sparse_linear_cpu(*args, rows_checked=self.rows_ascending)
        return group_sparse_linear(*args)

    def packed(self) -> PackedLinear:
        return PackedLinear(self.values, self.group_idx, self.group_ptr, (self.out_features, self.in_features),
                            self.spec, self.bias)

    def extra_repr(self) -> str:
        kept = self.values.numel() / (self.out_features * self.in_features)
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.spec}, kept={kept:.3f}"


def _widths(packed: PackedLinear) -> list[int]:
    from gmc.packed import block_widths

    return block_widths(packed.spec, packed.shape).tolist()


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
    directory: str | os.PathLike, model: nn.Module, tokenizer, packed: Mapping[str, PackedLinear], manifest: Mapping
) -> Path:
    """Write config, tokenizer, dense non-target weights and packed targets into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory / TOKENIZER_DIR)
    save_packed(directory, packed, non_target_state(model, packed), manifest)
    return directory


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


@dataclass
class LowerConfig:
    """What ``gmc lower`` does: which artifact, which backend, where to write."""

    artifact: str
    out: str
    backend: str = "torch"
    onnx_standard_ops: bool = False
    dtype: str = "float32"
    model: Optional[str] = None  # None: the model named in the artifact's manifest
    overwrite: bool = False  # replace an existing lowered model / ONNX file that gmc wrote
    trust_remote_code: bool = False

    def __post_init__(self):
        self.out = str(output_path(self.out))
        if self.backend not in BACKENDS:
            raise GmcError(f"bad backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.onnx_standard_ops and self.backend != "onnx":
            raise GmcError("--onnx-standard-ops only applies to --backend onnx")


def check_backend(backend: str, pattern: Pattern) -> None:
    """Refuse what a backend cannot run, naming what it can."""
    if isinstance(pattern, NMSpec):
        raise GmcError(
            f"backend {backend} cannot lower N:M pattern {pattern}: packed lowering supports group patterns "
            "(GOUTxGIN such as 1x256, 1x64, 32x32); N:M masks are applied as dense weights with zeros"
        )
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError as error:
            raise GmcError("--backend triton needs the triton package and a CUDA GPU; "
                           "use the CPU fallback --backend torch") from error
        if not torch.cuda.is_available():
            raise GmcError("--backend triton needs a CUDA GPU (none found); use the CPU fallback --backend torch")


@dataclass(frozen=True)
class LowerResult:
    path: Path
    packed_bytes: int  # target weights as stored: kept values + indices
    dense_bytes: int  # the same targets stored dense


def lower_artifact(config: LowerConfig) -> LowerResult:
    """Masks artifact -> lowered directory (torch, triton) or ONNX file."""
    from gmc.artifact import atomic_dir, load_artifact
    from gmc.model import load_model, model_fingerprint

    kind = "onnx" if config.backend == "onnx" else "lowered"
    check_output(config.out, kind, overwrite=config.overwrite, inputs=[config.artifact, config.model])
    artifact = load_artifact(config.artifact)
    pattern = artifact.pattern
    check_backend(config.backend, pattern)
    loaded = load_model(config.model or artifact.manifest["model"], dtype=config.dtype,
                        trust_remote_code=config.trust_remote_code)
    artifact.check_matches(loaded.model, model_fingerprint(loaded.model))
    packed = pack_model(loaded.model, artifact.masks, pattern, artifact.weights)
    manifest = {key: artifact.manifest[key] for key in ("model", "group", "method", "global_sparsity")
                if key in artifact.manifest}
    manifest.update(backend=config.backend, source_artifact=str(config.artifact))
    sizes = (sum(p.nbytes for p in packed.values()), sum(p.dense_nbytes for p in packed.values()))
    if config.backend == "onnx":
        from gmc.kernels.onnx_group_sparse import export_onnx

        swap_group_sparse_linears(loaded.model, packed)
        return LowerResult(export_onnx(loaded.model, config.out, standard_ops=config.onnx_standard_ops), *sizes)
    with atomic_dir(config.out, kind, config.overwrite) as tmp:
        save_lowered(tmp, loaded.model, loaded.tokenizer, packed, manifest)
    return LowerResult(Path(config.out), *sizes)
