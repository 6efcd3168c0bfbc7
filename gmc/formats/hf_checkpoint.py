"""A packed gmc model is an ordinary Hugging Face checkpoint: after ``import gmc``,
``AutoModelForCausalLM.from_pretrained(dir)`` builds ``GroupSparseLinear`` modules for its targets
(transformers' quantizer interface), and ``save_pretrained`` writes the same format back.

On disk (what ``gmc lower --backend torch`` writes, ``gmc.formats.lowered.save_lowered``)::

    config.json          the architecture's config, plus
                         "quantization_config": {"quant_method": "gmc", "format": "gmc-packed-bsc",
                             "format_version": 3, "provenance": {model, group, method, ...},
                             "layers": {"model.layers.0.self_attn.q_proj": {"shape": [d_out, d_in],
                                 "group": "1x256", "dtype": "float32" | "bfloat16" | "int8" | "int4",
                                 "groups": kept groups, "values": stored values (bytes for int4),
                                 "rows": packed columns, "bias": bool, ["scales": int4 scale numbers]},
                                 ...}}
                         "transformers_weights": REFUSAL (below)
    model.safetensors    every tensor under its module's name: the dense non-target weights and, per
                         target, GroupSparseLinear's buffers <name>.values, .group_idx, .group_ptr,
                         [.bias], [.scales] (gmc.kernels.packed has the layout)
    tokenizer files, generation_config.json

How a load goes: transformers reads ``quant_method`` and hands the model, built on ``meta``, to
``GmcPackedQuantizer``, which swaps each target ``nn.Linear`` for an empty ``GroupSparseLinear`` of
the sizes ``layers`` gives; the standard loader then fills the buffers from ``model.safetensors``
(so no dense target weight ever exists), and the quantizer rebuilds each layer's row index, which
also checks the stored indices against the shapes.

Why ``transformers_weights``: transformers skips a ``quant_method`` it does not know with a warning
and would load the model with random target weights. The config's weights-file field holds a value
that is not a file name, so the load fails there with transformers' error quoting it
("... `import gmc` before from_pretrained ..."); the gmc quantizer removes the field before
transformers resolves the weights file, so with gmc imported ``model.safetensors`` loads.
transformers drops that field whenever it saves a config and gives a quantizer no hook after the
config is written, so every packed model (loaded, or marked by ``attach_packed_config``) gets a
``save_pretrained`` that runs transformers' own and then ``refuse_without_gmc`` (which ``push_to_hub``
calls as well).

Nothing in a checkpoint runs: safetensors only (a pickled weights file is refused before it is
read), and code named by the config (``auto_map``) is transformers' ``trust_remote_code`` decision.
``GmcPackedQuantizer`` and ``GmcPackedConfig`` are registered with transformers when this module is
imported.
"""
from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Mapping, Optional

import torch
from safetensors import SafetensorError, safe_open
from transformers.quantizers import (
    HfQuantizer,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from gmc.errors import GmcError
from gmc.formats.atomic import atomic_dir, atomic_write_bytes
from gmc.groups import GroupSpec, parse_pattern
from gmc.kernels.linear import GroupSparseLinear

QUANT_METHOD = "gmc"
FORMAT = "gmc-packed-bsc"
FORMAT_VERSION = 3
INT8_WORDS_SINCE = 3  # int8 values in words of 4 (gmc.kernels.packed); before, row-major (float layouts unchanged)
REFUSAL = "gmc packed checkpoint: run `import gmc` before from_pretrained (model.safetensors holds packed weights)"
VALUE_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@register_quantization_config(QUANT_METHOD)
class GmcPackedConfig(QuantizationConfigMixin):
    """``quantization_config`` of a packed checkpoint: each target's packed sizes, enough to build
    empty ``GroupSparseLinear`` modules before the weights load, and where the masks came from."""

    def __init__(self, layers: Mapping[str, Mapping], format: str = FORMAT, format_version: int = FORMAT_VERSION,
                 provenance: Optional[Mapping] = None, **kwargs):
        self.quant_method = QUANT_METHOD
        self.format = format
        self.format_version = format_version
        self.layers = {name: dict(info) for name, info in layers.items()} if isinstance(layers, Mapping) else layers
        self.provenance = dict(provenance or {})
        self.post_init()

    def post_init(self):
        if self.format != FORMAT or self.format_version not in (INT8_WORDS_SINCE - 1, FORMAT_VERSION):
            raise GmcError(f"packed checkpoint has format {self.format!r} v{self.format_version}, this gmc reads "
                           f"{FORMAT!r} v{INT8_WORDS_SINCE - 1} to v{FORMAT_VERSION}: re-run `gmc lower`")
        if not isinstance(self.layers, dict) or not self.layers:
            raise GmcError("config.json quantization_config has no \"layers\" object; re-run `gmc lower`")
        for name, info in self.layers.items():
            _check_layer(name, info)
        if self.format_version < INT8_WORDS_SINCE:
            int8 = next((name for name, info in self.layers.items() if info["dtype"] == "int8"), None)
            if int8 is not None:
                raise GmcError(f"packed checkpoint v{self.format_version} stores int8 layer {int8} row-major, this "
                               f"gmc reads int8 in words of 4 (v{INT8_WORDS_SINCE}): re-run `gmc lower`")
            self.format_version = FORMAT_VERSION  # the same bytes: written back as this version

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "format": self.format, "format_version": self.format_version,
                "provenance": dict(self.provenance), "layers": {name: dict(info) for name, info in self.layers.items()}}


def _check_layer(name: str, info) -> None:
    """One ``layers`` entry: positive shape, a group pattern, a known dtype, sizes as integers."""
    def bad(what: str) -> GmcError:
        return GmcError(f"config.json quantization_config layer {name} {what}; re-run `gmc lower`")

    if not isinstance(info, dict):
        raise bad(f"is a JSON {type(info).__name__}, not an object")
    shape = info.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n > 0 for n in shape)):
        raise bad(f"has shape {shape!r}, expected [d_out, d_in]")
    try:
        spec = parse_pattern(info.get("group"))
    except (GmcError, TypeError, ValueError, AttributeError) as error:
        raise bad(f"has group {info.get('group')!r} ({error})") from error
    if not isinstance(spec, GroupSpec):
        raise bad(f"has group {spec}, not a GOUTxGIN group pattern")
    if info.get("dtype") not in VALUE_DTYPES:
        raise bad(f"has dtype {info.get('dtype')!r}, expected one of {', '.join(VALUE_DTYPES)}")
    for key in ("groups", "values", "rows", *(("scales",) if info["dtype"] == "int4" else ())):
        if type(info.get(key)) is not int or info[key] < 0:
            raise bad(f"has {key} {info.get(key)!r}, expected a count")
    if type(info.get("bias")) is not bool:
        raise bad(f"has bias {info.get('bias')!r}, expected true or false")


def layer_info(module: GroupSparseLinear) -> dict:
    """The ``layers`` entry of one packed module."""
    int4 = module.values.dtype == torch.uint8
    info = {"shape": [module.out_features, module.in_features], "group": str(module.spec),
            "dtype": "int4" if int4 else str(module.values.dtype).removeprefix("torch."),
            "groups": module.group_idx.numel(), "values": module.values.numel(), "rows": module.row_idx.numel(),
            "bias": module.bias is not None}
    return {**info, "scales": module.scales.numel()} if int4 else info


def empty_layer(info: Mapping, float_dtype: torch.dtype) -> GroupSparseLinear:
    """A ``GroupSparseLinear`` on ``meta`` with the sizes of ``info``; float values in ``float_dtype``."""
    dtype = {"int8": torch.int8, "int4": torch.uint8}.get(info["dtype"], float_dtype)
    return GroupSparseLinear.empty(tuple(info["shape"]), parse_pattern(info["group"]), groups=info["groups"],
                                   nnz=info["values"], rows=info["rows"], dtype=dtype, float_dtype=float_dtype,
                                   bias=info["bias"], scales=info.get("scales", 0))


@register_quantizer(QUANT_METHOD)
class GmcPackedQuantizer(HfQuantizer):
    """Loads packed checkpoints: swaps targets for empty ``GroupSparseLinear`` before the weights load,
    rebuilds their row indices after. It never packs a dense model (``gmc lower`` does)."""

    requires_calibration = True  # a quantization_config passed for a dense model is refused by transformers
    quantization_config: GmcPackedConfig

    def update_attn_implementation(self, config):
        # the one hook that sees the config before transformers resolves the weights file
        if getattr(config, "transformers_weights", None) == REFUSAL:
            del config.transformers_weights
        return config

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, dtype=None, **kwargs):
        where = getattr(model.config, "name_or_path", "") or "the checkpoint"
        check_weight_files(where, checkpoint_files or [], self.quantization_config.layers)
        float_dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
        for name, info in self.quantization_config.layers.items():
            parent_name, _, child = name.rpartition(".")
            try:
                parent = model.get_submodule(parent_name) if parent_name else model
            except AttributeError:
                parent = None
            old = getattr(parent, child, None)
            if not isinstance(old, torch.nn.Linear):
                raise GmcError(f"corrupted packed checkpoint {where}: layer {name} is not a linear of "
                               f"{type(model).__name__}; re-run `gmc lower`")
            if [old.out_features, old.in_features] != info["shape"]:
                raise GmcError(f"corrupted packed checkpoint {where}: layer {name} has shape {info['shape']} in "
                               f"config.json, the model's linear is [{old.out_features}, {old.in_features}]; "
                               f"re-run `gmc lower`")
            setattr(parent, child, empty_layer(info, float_dtype))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        _refuse_without_gmc_on_save(model)
        where = getattr(model.config, "name_or_path", "") or "the checkpoint"
        for name, module in model.named_modules():
            if isinstance(module, GroupSparseLinear):
                try:
                    module.index_rows(name=name)  # checks the indices read (gmc.kernels.packed.check_indices)
                except GmcError as error:  # names the layer and the tensor
                    raise GmcError(f"corrupted packed checkpoint {where}: {error}; re-run `gmc lower`") from error
                except (RuntimeError, IndexError) as error:
                    raise GmcError(f"corrupted packed checkpoint {where}: layer {name} "
                                   f"({str(error).splitlines()[0][:160]}); re-run `gmc lower`") from error
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def save_dense(model, tokenizer, path: str | Path, overwrite: bool = False) -> Path:
    """``model`` (a dense transformers model) and ``tokenizer``, when it saves, as an HF checkpoint at
    ``path``, written atomically as a gmc ``dense`` output, without transformers' shard bar (the
    commands that save show their own steps)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with atomic_dir(path, "dense", overwrite) as tmp:
            model.save_pretrained(tmp)
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(tmp)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return Path(path)


def attach_packed_config(model, provenance: Optional[Mapping] = None):
    """Mark ``model``, whose targets were swapped to ``GroupSparseLinear``
    (``gmc.formats.lowered.swap_group_sparse_linears``), as a packed checkpoint: ``model.save_pretrained(dir)``
    then writes the format ``from_pretrained`` loads back. ``provenance``: JSON values saved in
    ``quantization_config`` (source artifact, method, group...). Returns ``model``."""
    layers = {name: layer_info(module) for name, module in model.named_modules()
              if isinstance(module, GroupSparseLinear)}
    if not layers:
        raise GmcError(f"{type(model).__name__} has no GroupSparseLinear modules: swap its targets first "
                       f"(gmc.formats.lowered.swap_group_sparse_linears)")
    quantizer = GmcPackedQuantizer(GmcPackedConfig(layers, provenance=provenance), pre_quantized=True)
    model.hf_quantizer = quantizer
    model.quantization_method = QUANT_METHOD
    quantizer.postprocess_model(model)  # config.quantization_config, row indices, save_pretrained
    return model


def _refuse_without_gmc_on_save(model) -> None:
    """``model.save_pretrained`` writes the refusal too: transformers' own, then ``refuse_without_gmc``."""
    def save_pretrained(self, save_directory, *args, **kwargs):
        type(self).save_pretrained(self, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            refuse_without_gmc(save_directory)

    model.save_pretrained = types.MethodType(save_pretrained, model)


def refuse_without_gmc(directory) -> None:
    """Add the ``transformers_weights`` refusal to the config.json ``save_pretrained`` wrote in
    ``directory`` (transformers drops that field when it saves a config, so it is added after)."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    config["transformers_weights"] = REFUSAL
    atomic_write_bytes(path, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def check_weight_files(where, files, layers: Mapping[str, Mapping]) -> None:
    """Refuse weights that are not safetensors (a pickle could run code) and packed tensors missing or of
    the wrong size: read from the safetensors headers only, before any weight is loaded."""
    pickles = [Path(f).name for f in files if not str(f).endswith(".safetensors")]
    if pickles:
        raise GmcError(f"packed checkpoint {where} holds {pickles[0]}: gmc loads safetensors weights only "
                       f"(a pickle could run code); re-run `gmc lower`")
    shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                shapes.update({key: (handle.get_slice(key).get_shape(), handle.get_slice(key).get_dtype())
                               for key in handle.keys()})
        except (SafetensorError, OSError) as error:
            raise GmcError(f"corrupted packed checkpoint: cannot read {file} ({error}); re-run `gmc lower`") from error
    for name, info in layers.items():
        g_in = parse_pattern(info["group"]).g_in
        expected = {"values": ([info["values"]], {"int8": "I8", "int4": "U8"}.get(info["dtype"])),
                    "group_idx": ([info["groups"]], "I32"),
                    "group_ptr": ([-(-info["shape"][1] // g_in) + 1], "I32")}
        if info["bias"]:
            expected["bias"] = ([info["shape"][0]], None)
        if info["dtype"] == "int8":
            expected["scales"] = ([info["rows"]], "F32")
        if info["dtype"] == "int4":
            expected["scales"] = ([info["scales"]], "F16")
        for leaf, (shape, dtype) in expected.items():
            key = f"{name}.{leaf}"
            if key not in shapes:
                raise GmcError(f"corrupted packed checkpoint {where}: model.safetensors lacks {key}; "
                               f"re-run `gmc lower`")
            got_shape, got_dtype = shapes[key]
            if list(got_shape) != shape or (dtype is not None and got_dtype != dtype):
                raise GmcError(f"corrupted packed checkpoint {where}: {key} is {got_dtype} {list(got_shape)}, "
                               f"config.json needs {dtype or 'float'} {shape}; re-run `gmc lower`")


def packed_config(directory) -> Optional[dict]:
    """The ``quantization_config`` of a packed checkpoint in ``directory``, None if it is not one
    (no config.json, or one without a gmc ``quant_method``). Reads config.json only."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise GmcError(f"corrupted model: {path} is not valid JSON ({error})") from error
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(quantization, dict) and quantization.get("quant_method") == QUANT_METHOD:
        return quantization
    return None


def check_packed_checkpoint(directory, trust_remote_code: bool = False) -> dict:
    """Refuse, in one line, a directory that is not a loadable packed checkpoint before anything
    loads: not one at all, pickled weights, code to run without
    ``trust_remote_code``, a malformed ``quantization_config``. Returns that config."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise GmcError(f"{directory} is not a packed gmc checkpoint: config.json is missing (run `gmc lower` first)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise GmcError(f"corrupted packed checkpoint: {config_path} is not valid JSON ({error}); "
                       f"re-run `gmc lower`") from error
    if not isinstance(config, dict):
        raise GmcError(f"corrupted packed checkpoint: {config_path} holds a JSON {type(config).__name__}, "
                       f"not an object; re-run `gmc lower`")
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") != QUANT_METHOD:
        raise GmcError(f"{directory} is not a packed gmc checkpoint: {config_path.name} has no gmc "
                       f"quantization_config; re-run `gmc lower`")
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if pickles:
        raise GmcError(f"packed checkpoint {directory} holds {pickles[0]}: gmc loads safetensors weights only "
                       f"(a pickle could run code); re-run `gmc lower`")
    if config.get("auto_map") and not trust_remote_code:
        raise GmcError(f"packed checkpoint {directory}: config.json names code to run (auto_map); refused "
                       f"without --trust-remote-code")
    fields = {key: value for key, value in quantization.items() if key != "quant_method"}
    try:
        GmcPackedConfig(**fields)
    except TypeError as error:
        raise GmcError(f"corrupted packed checkpoint {directory}: config.json quantization_config ({error}); "
                       f"re-run `gmc lower`") from error
    except GmcError as error:
        raise GmcError(f"corrupted packed checkpoint {directory}: {error}") from error
    return quantization
