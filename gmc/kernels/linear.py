"""``GroupSparseLinear``: the ``nn.Linear`` replacement whose forward is ``gmc::group_sparse_linear``
on a packed layer's buffers, and ``swap_group_sparse_linears``, the module swap that puts it in an
eager model (the eager form of the lowering pass: what ``from_pretrained`` of a packed checkpoint,
``gmc.lower_`` and HF's own ``generate`` run).

The layout follows the device: packed (``gmc/kernels/packed.py``) on the CPU, tiled
(``gmc/kernels/tiled.py``) on CUDA, converted when the module moves (``model.to("cuda")``) or its
buffers are loaded there. Only the values (and int8/int4 scales) and the kernel's indices change;
the group indices stay, and ``state_dict`` / ``packed()`` always give the packed layout, so a
checkpoint saved from a GPU is the one saved from a CPU."""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn

from gmc.errors import GmcError
from gmc.groups import GroupSpec
from gmc.kernels.group_sparse_linear import group_sparse_linear
from gmc.kernels.packed import PackedLinear, rows_from_groups
from gmc.kernels.tiled import TiledInputs, is_tiled, tile, untile


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
        self.register_buffer("scales", packed.scales)  # int8: [R] fp32, int4: fp16 (d, m) per 32 k rows, else None
        if packed.values.is_cuda:
            self._hold(packed)

    @classmethod
    def empty(cls, shape: tuple[int, int], spec: GroupSpec, groups: int, nnz: int, rows: int, dtype: torch.dtype,
              float_dtype: torch.dtype, bias: bool, device="meta", scales: int = 0) -> "GroupSparseLinear":
        """A layer of these packed sizes with uninitialised buffers: what a checkpoint loader builds
        before it assigns the stored tensors (then ``index_rows``). ``dtype``: of the values (int8,
        uint8 for int4, or float), ``float_dtype``: of the bias; ``scales``: fp16 numbers of int4 values."""
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
        stored_scales = {torch.int8: (rows, torch.float32), torch.uint8: (scales, torch.float16)}.get(dtype)
        module.register_buffer("scales", None if stored_scales is None else
                               torch.empty(stored_scales[0], dtype=stored_scales[1], device=device))
        return module

    def index_rows(self, tiled: Optional[bool] = None, name: str = "") -> None:
        """Rebuild ``row_idx``/``row_ptr`` (not stored) from ``group_idx``/``group_ptr`` over packed
        values just loaded, checking them against the shape (``PackedLinear``: ``check_indices``, errors
        naming the layer ``name``); tile them on CUDA (or as ``tiled`` says)."""
        self._hold(PackedLinear(self.values, self.group_idx, self.group_ptr, (self.out_features, self.in_features),
                                self.spec, self.bias, self.scales, name), tiled)

    @property
    def tiled(self) -> bool:
        """The buffers are in the tiled (CUDA) layout."""
        return is_tiled(self.row_idx)

    def _hold(self, layer: PackedLinear, tiled: Optional[bool] = None) -> None:
        """Take ``layer``'s tensors, tiled when ``tiled`` (by default: when they are on CUDA)."""
        self.values, self.row_idx, self.row_ptr, self.scales = layer.values, layer.row_idx, layer.row_ptr, layer.scales
        if layer.values.is_cuda if tiled is None else tiled:
            tiled = tile(layer.values, layer.row_idx, layer.row_ptr, layer.scales, *layer.shape, layer.spec.g_in)
            self.values, self.row_idx, self.row_ptr, self.scales = (tiled.values, tiled.entries, tiled.tile_ptr,
                                                                    tiled.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d_in] -> [..., d_out]
        # eager CPU float32/bfloat16 goes from the dispatcher straight into the compiled kernel (no
        # Python between: gmc/kernels/group_sparse_linear.py); export, compile and ONNX see one op node
        return group_sparse_linear(x, self.values, self.row_idx, self.row_ptr, self.bias, self.out_features,
                                   self.spec.g_in, self.scales)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) converts floating buffers: int8 scales stay fp32 and int4 scales fp16 (the
        # op's contract), and only follow the device
        scales = self.scales
        super()._apply(fn, recurse)
        if scales is not None and self.scales.dtype != scales.dtype:
            self.scales = scales.to(self.scales.device)
        if self.values.device.type != "meta" and self.values.is_cuda != self.tiled:  # the layout follows the device
            self._hold(self.packed())
        return self

    def packed(self) -> PackedLinear:
        """The layer in the packed layout (untiled from CUDA's, on the module's device)."""
        values, scales = self.values, self.scales
        shape = (self.out_features, self.in_features)
        if self.tiled:
            row_idx, row_ptr = rows_from_groups(self.group_idx, self.group_ptr, self.spec, shape)
            values, scales = untile(TiledInputs(self.values, self.row_idx, self.row_ptr, self.scales), row_idx, row_ptr,
                                    *shape, self.spec.g_in)
        return PackedLinear(values, self.group_idx, self.group_ptr, shape, self.spec, self.bias, scales)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tiled:  # what is saved is the packed layout, from any device
            packed = self.packed()
            destination[prefix + "values"] = packed.values
            if packed.scales is not None:
                destination[prefix + "scales"] = packed.scales

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        tiled = self.tiled
        if tiled:  # the state holds packed values: load them as such, then tile again
            self._hold(self.packed(), tiled=False)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.values.device.type != "meta":  # the row index follows the group indices loaded (and checks them)
            self.index_rows(tiled=tiled, name=prefix.removesuffix("."))

    def extra_repr(self) -> str:
        kept = self.values.numel() / (self.out_features * self.in_features)
        kept *= 2 if self.values.dtype == torch.uint8 else 1  # int4: two codes a byte
        quantized = {torch.int8: ", int8", torch.uint8: ", int4"}.get(self.values.dtype, "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.spec}, "
                f"kept={kept:.3f}{quantized}")


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
