"""``gmc info``: what a path is and holds, per layer and in total, read from its headers.

Four forms, told apart by their files:

- a masks artifact (``manifest.json`` + ``masks.safetensors``): each target's shape and kept share,
  the method, allocation and provenance of the manifest, the bytes of its files;
- a lowered directory (``config.json`` with a gmc ``quantization_config``): each packed layer's
  shape, group, value dtype, kept share, bytes on disk (values, indices, scales: safetensors
  headers) and in memory (plus the row index the kernels rebuild), the format, provenance,
  compiled packages and ``program.pt2``;
- an ONNX model directory (``genai_config.json``, checked as ``gmc.formats.onnx`` checks it): opsets,
  the group-sparse layers (gmc's op nodes, or standard-op scatter-adds) with their value dtype and
  initializer bytes, gmc's record of how it was made, the op library it names;
- a plain HF checkpoint (``config.json`` + ``*.safetensors``): each target's zero share and, for a
  group pattern, the share of all-zero groups and of the zeros lying in them: whether
  ``gmc lower DIR --group G`` would find its masks (``gmc.lower.from_zeros``).

Why from headers: a description must be quick and must not depend on building the model, so
nothing is built or run; weights are read only for a checkpoint's zeros, one tensor at a time, and
a packed layer's group indices (4 bytes per kept group) only to count its kept weights exactly.
``describe`` returns one JSON-ready dict (``gmc info --json`` prints it); ``render`` prints it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from gmc.config import default_of, option
from gmc.errors import GmcError
from gmc.formats.artifact import MANIFEST_FILE, MASKS_FILE
from gmc.formats.compiled import COMPILED_DIR, INFO_FILE, has_compiled
from gmc.formats.hf_checkpoint import check_packed_checkpoint, check_weight_files, packed_config
from gmc.formats.lowered import PROGRAM_FILE
from gmc.formats.onnx import is_onnx_dir
from gmc.graph.targets import TargetFilter, layer_index, projection_rank
from gmc.groups import GroupSpec, kept_params, parse_pattern
from gmc.lower.from_zeros import ZeroGroups, zero_groups
from gmc.masks.prune import PruneConfig

KINDS = {"masks": "masks artifact", "lowered": "lowered model", "onnx": "ONNX model directory",
         "checkpoint": "HF checkpoint"}
PROVENANCE = ("model", "model_fingerprint", "method", "allocation", "target_sparsity", "global_sparsity",
              "calibration", "nsamples", "seq_len", "seed", "weights_updated", "provenance", "gmc_version")
STORED = ("values", "group_idx", "group_ptr", "scales")  # a packed layer's tensors on disk (the bias aside)
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}  # safetensors dtype -> bytes an element
_FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class InfoConfig:
    """What ``gmc info`` describes, and how it prints it."""

    path: str
    group: Optional[str] = option(None, "HF checkpoint: the GOUTxGIN groups whose all-zero share is measured "
                                        "[default: gmc prune's --group].")
    as_json: bool = option(False, "Print one JSON document instead of tables.", flag="--json")

    def __post_init__(self):
        if self.group is not None and not isinstance(parse_pattern(self.group), GroupSpec):
            raise GmcError(f"--group {self.group} is N:M: zero groups are GOUTxGIN groups (1x64, 32x32)")


def describe(path: str, group: Optional[str] = None) -> dict:
    """What ``path`` is and holds (see the module docstring); ``group``: a checkpoint's zero groups."""
    where = Path(path).expanduser()
    kind = path_kind(where)
    if group is not None and kind != "checkpoint":
        article = "an" if KINDS[kind].startswith("ONNX") else "a"
        raise GmcError(f"--group measures the zero groups of a HF checkpoint; {path} is {article} {KINDS[kind]}, "
                       f"which states its own layout: drop --group")
    info = {"path": str(where), "kind": kind}
    info.update(_DESCRIBE[kind](where, group))
    files = {str(p.relative_to(where)): p.stat().st_size for p in sorted(where.rglob("*")) if p.is_file()}
    return {**info, "files": files, "bytes_on_disk": sum(files.values())}


def path_kind(path: Path) -> str:
    """``masks``, ``lowered``, ``onnx`` or ``checkpoint``; a path that is none of them is refused."""
    if is_onnx_dir(path):
        return "onnx"
    if path.is_dir() and (path / MANIFEST_FILE).is_file() and (path / MASKS_FILE).is_file():
        return "masks"
    if path.is_dir() and packed_config(path) is not None:
        return "lowered"
    if path.is_dir() and (path / "config.json").is_file():
        return "checkpoint"
    what = "does not exist" if not path.exists() else "is none of the forms gmc reads"
    raise GmcError(f"{path} {what}: expected a masks artifact (manifest.json + masks.safetensors), a lowered "
                   f"directory (gmc lower), an ONNX model directory (genai_config.json) or a HF checkpoint "
                   f"(config.json + *.safetensors)")


def _ordered(names) -> list[str]:
    """Decoder layer by decoder layer, projections in table order (q, k, v, o, gate, up, down)."""
    def key(name: str):
        index = layer_index(name)
        return (index is not None, index or 0, projection_rank(name), name)
    return sorted(names, key=key)


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise GmcError(f"corrupted {what}: {path} is not valid JSON ({error})") from error


def _masks(path: Path, group) -> dict:
    manifest = _read_json(path / MANIFEST_FILE, "masks artifact")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shapes"), dict) or "group" not in manifest:
        raise GmcError(f"corrupted masks artifact {path}: {MANIFEST_FILE} lacks its group or shapes")
    pattern = parse_pattern(manifest["group"])
    try:
        masks = load_file(path / MASKS_FILE)  # [G_out, G_in] bool each: small beside the weights
    except (SafetensorError, OSError) as error:
        raise GmcError(f"corrupted masks artifact {path}: cannot read {MASKS_FILE} ({error})") from error
    layers = []
    for name in _ordered(masks):
        shape = tuple(manifest["shapes"].get(name) or ())
        if len(shape) != 2 or tuple(masks[name].shape) != pattern.grid(shape):
            raise GmcError(f"corrupted masks artifact {path}: the mask of {name} does not fit shape {list(shape)}")
        kept = kept_params(pattern, masks[name], shape)
        layers.append({"name": name, "shape": list(shape), "params": shape[0] * shape[1], "kept_params": kept,
                       "kept": kept / (shape[0] * shape[1]), "groups": masks[name].numel(),
                       "kept_groups": int(masks[name].bool().sum())})
    return {"group": str(pattern), "method": manifest.get("method"), "allocation": manifest.get("allocation"),
            "provenance": {key: manifest[key] for key in PROVENANCE if key in manifest},
            "layers": layers, "total": _kept_total(layers, ("groups", "kept_groups"))}


def _kept_total(layers: list[dict], sums=()) -> dict:
    params, kept = sum(x["params"] for x in layers), sum(x["kept_params"] for x in layers)
    return {"name": "total", "params": params, "kept_params": kept, "kept": kept / max(params, 1),
            **{key: sum(x[key] for x in layers) for key in sums}}


def _headers(files) -> dict[str, tuple[list[int], str]]:
    """``{tensor name: (shape, safetensors dtype)}`` of ``files``, from their headers only."""
    found = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    tensor = handle.get_slice(key)
                    found[key] = (list(tensor.get_shape()), tensor.get_dtype())
        except (SafetensorError, OSError) as error:
            raise GmcError(f"corrupted model: cannot read {file} ({error})") from error
    return found


def _nbytes(header: tuple[list[int], str]) -> int:
    shape, dtype = header
    count = 1
    for size in shape:
        count *= size
    return count * _BYTES.get(dtype, 0)


def _lowered(path: Path, group) -> dict:
    quantization = check_packed_checkpoint(path, trust_remote_code=True)  # info runs no code of the checkpoint
    files = sorted(path.glob("*.safetensors"))
    check_weight_files(path, files, quantization["layers"])
    headers = _headers(files)
    config = _read_json(path / "config.json", "lowered model")
    dense_dtype = config.get("dtype") or config.get("torch_dtype")
    dense_dtype = dense_dtype if dense_dtype in _FLOAT_BYTES else "float32"  # what the dense targets would take
    indices = _group_indices(files, quantization["layers"])
    layers = []
    for name in _ordered(quantization["layers"]):
        spec = quantization["layers"][name]
        shape, pattern = tuple(spec["shape"]), parse_pattern(spec["group"])
        kept = _kept_from_indices(*indices[name], pattern, shape)
        disk = sum(_nbytes(headers[f"{name}.{leaf}"]) for leaf in STORED if f"{name}.{leaf}" in headers)
        memory = disk + 8 * spec["rows"] + 4 * (pattern.grid(shape)[1] + 1)  # + row_idx [R] int64, row_ptr int32
        params = shape[0] * shape[1]
        layers.append({"name": name, "shape": list(shape), "group": spec["group"], "dtype": spec["dtype"],
                       "params": params, "kept_params": kept, "kept": kept / params, "groups": spec["groups"],
                       "disk_bytes": disk, "memory_bytes": memory, "dense_bytes": params * _FLOAT_BYTES[dense_dtype]})
    total = _kept_total(layers, ("groups", "disk_bytes", "memory_bytes", "dense_bytes"))
    total["packed_to_dense"] = total["disk_bytes"] / max(total["dense_bytes"], 1)
    compiled = None
    if has_compiled(path):
        stated = _read_json(path / COMPILED_DIR / INFO_FILE, "compiled programs")
        compiled = {key: stated.get(key) for key in ("max_len", "dtype", "device", "torch")} \
            if isinstance(stated, dict) else {}
        compiled["bytes"] = sum(p.stat().st_size for p in (path / COMPILED_DIR).rglob("*") if p.is_file())
    program = path / PROGRAM_FILE
    return {"format": {"name": quantization["format"], "version": quantization["format_version"]},
            "provenance": quantization.get("provenance") or {}, "dense_dtype": dense_dtype, "layers": layers,
            "total": total,
            "compiled": compiled, "program_bytes": program.stat().st_size if program.is_file() else None}


def _group_indices(files, layers) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (group_idx, group_ptr)}``: 4 bytes a kept group, read to count kept weights exactly."""
    found = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            keys = set(handle.keys())
            for name in layers:
                if f"{name}.group_idx" in keys and f"{name}.group_ptr" in keys:
                    found[name] = handle.get_tensor(f"{name}.group_idx"), handle.get_tensor(f"{name}.group_ptr")
    return found


def _kept_from_indices(group_idx: torch.Tensor, group_ptr: torch.Tensor, pattern: GroupSpec, shape) -> int:
    """Weights in the kept groups of a packed layer (ragged edge groups counted at their real size)."""
    from gmc.kernels.packed import check_indices

    check_indices(group_idx, group_ptr, pattern, shape)
    blocks = torch.repeat_interleave(torch.arange(len(group_ptr) - 1), (group_ptr[1:] - group_ptr[:-1]).long())
    return int(pattern.group_sizes(shape)[group_idx.long(), blocks].sum())  # [kept groups] summed


def _onnx(path: Path, group) -> dict:
    """An ONNX model directory: its group-sparse layers (gmc's op nodes, or the standard-op scatter-adds
    that stand for one), what gmc wrote about it, and whether it carries gmc's op library."""
    import onnx

    from gmc.formats.onnx import METADATA_FILE, check_onnx_dir

    config = check_onnx_dir(path)
    model = onnx.load(str(config["gmc_model"]), load_external_data=False)
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    layers = []
    for node in graph.node:
        standard = node.op_type == "ScatterElements" and node.name.endswith("/ScatterAdd")
        if node.domain != "gmc" and not standard:
            continue
        prefix = node.name.rsplit("/", 1)[0]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        names = node.input[1:] if not standard else [n for n in initializers if n.startswith(prefix + ".")]
        values = initializers.get(node.input[1]) if not standard else None
        layers.append({"name": prefix, "op": f"{node.domain}::{node.op_type}" if not standard else "standard ops",
                       "d_out": attrs.get("d_out"), "g_in": attrs.get("g_in"),
                       "dtype": _ONNX_VALUES.get(values.data_type, "float32") if values is not None else "float32",
                       "bytes": sum(_onnx_bytes(initializers[name]) for name in names if name in initializers)})
    meta = path / METADATA_FILE
    return {"opset": {entry.domain or "ai.onnx": entry.version for entry in model.opset_import},
            "metadata": _read_json(meta, "ONNX model directory") if meta.is_file() else {},
            "library": str(config["gmc_library"].name) if "gmc_library" in config else None,
            "initializers": len(initializers), "initializer_bytes": sum(map(_onnx_bytes, initializers.values())),
            "layers": layers, "total": {"name": "total", "nodes": len(layers),
                                        "bytes": sum(x["bytes"] for x in layers)}}


_ONNX_VALUES = {1: "float32", 3: "int8", 2: "int4"}  # onnx.TensorProto FLOAT, INT8, UINT8 (two int4 codes a byte)


def _onnx_bytes(tensor) -> int:
    import onnx

    count = 1
    for size in tensor.dims:
        count *= size
    try:
        return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return len(tensor.raw_data)


def _checkpoint(path: Path, group) -> dict:
    pattern = parse_pattern(group or default_of(PruneConfig, "group"))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise GmcError(f"{path} holds no *.safetensors weights: gmc info reads safetensors only (a pickle could "
                       f"run code)")
    chosen, stats, layers = TargetFilter(), {}, {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    name = key.removesuffix(".weight")
                    if name == key or not chosen(name) or len(handle.get_slice(key).get_shape()) != 2:
                        continue
                    weight = handle.get_tensor(key)  # [d_out, d_in], one at a time
                    stats[name] = zero_groups(weight, pattern)[1]
                    layers[name] = {"name": name, "shape": list(weight.shape),
                                    "dtype": str(weight.dtype).removeprefix("torch.")}
        except (SafetensorError, OSError) as error:
            raise GmcError(f"corrupted HF checkpoint: cannot read {file} ({error})") from error
    if not layers:
        raise chosen.none_found(str(path))
    config = _read_json(path / "config.json", "HF checkpoint")
    ordered = [{**layers[name], **_zero_shares(stats[name])} for name in _ordered(layers)]
    return {"group": str(pattern), "model_type": config.get("model_type") if isinstance(config, dict) else None,
            "layers": ordered, "total": {"name": "total", **_zero_shares(sum(stats.values(), ZeroGroups()))}}


def _zero_shares(counts: ZeroGroups) -> dict:
    return {"params": counts.params, "zeros": counts.zero_fraction, "zero_groups": counts.zero_group_fraction,
            "grouped": counts.grouped_fraction}


_DESCRIBE = {"masks": _masks, "lowered": _lowered, "onnx": _onnx, "checkpoint": _checkpoint}

# ------------------------------------------------------------------------------ tables


def _size(count) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"


def _share(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def _shape(shape) -> str:
    return "" if shape is None else "x".join(map(str, shape))


def _text(value) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


COLUMNS = {  # per kind: (header, key, format) of each column; the total row leaves out what it lacks
    "masks": [("layer", "name", _text), ("shape", "shape", _shape), ("groups kept", "kept_groups", _text),
              ("of", "groups", _text), ("kept", "kept", _share)],
    "lowered": [("layer", "name", _text), ("shape", "shape", _shape), ("group", "group", _text),
                ("dtype", "dtype", _text), ("kept", "kept", _share), ("on disk", "disk_bytes", _size),
                ("in memory", "memory_bytes", _size), ("dense", "dense_bytes", _size)],
    "onnx": [("layer", "name", _text), ("op", "op", _text), ("values", "dtype", _text), ("d_out", "d_out", _text),
             ("g_in", "g_in", _text), ("initializers", "bytes", _size)],
    "checkpoint": [("layer", "name", _text), ("shape", "shape", _shape), ("dtype", "dtype", _text),
                   ("zero", "zeros", _share), ("zero groups", "zero_groups", _share),
                   ("zeros in zero groups", "grouped", _share)],
}


def render(info: dict, console) -> None:
    """Print ``describe``'s ``info`` on a rich ``console``: a table of its layers with a total row,
    then a few lines on the whole."""
    from rich.table import Table

    kind = info["kind"]
    title = f"{KINDS[kind]} {info['path']}" + (f" ({info['group']} groups)" if "group" in info else "")
    table = Table(*(header for header, _, _ in COLUMNS[kind]), title=title)
    rows = info["layers"] + [info["total"]]
    for index, row in enumerate(rows):
        table.add_row(*(fmt(row[key]) if key in row else "" for _, key, fmt in COLUMNS[kind]),
                      end_section=index == len(rows) - 2)
    console.print(table)
    for label, value in summary_lines(info):
        console.print(f"{label}: [bold]{value}[/bold]", highlight=False)


def summary_lines(info: dict) -> list[tuple[str, str]]:
    """``(label, value)`` lines below the table."""
    kind, total = info["kind"], info["total"]
    lines = []
    if kind in ("masks", "lowered"):
        lines.append(("kept", f"{_share(total['kept'])} of {total['params']:,} target weights"))
    if kind == "masks":
        lines.append(("method", f"{info['method']} ({info['allocation']} allocation)"))
    if kind == "lowered":
        lines.append(("format", f"{info['format']['name']} v{info['format']['version']}"))
        lines.append(("packed targets", f"{_size(total['disk_bytes'])} on disk = {total['packed_to_dense']:.3f}x "
                                        f"dense {info['dense_dtype']}, {_size(total['memory_bytes'])} in memory"))
        compiled = info["compiled"]
        stated = None if compiled is None else [f"{key} {compiled.get(key)}" for key in ("max_len", "dtype", "device",
                                                                                          "torch")]
        lines.append(("compiled", "none" if compiled is None else ", ".join([*stated, _size(compiled["bytes"])])))
        lines.append((PROGRAM_FILE, "none" if info["program_bytes"] is None else _size(info["program_bytes"])))
    if kind == "onnx":
        lines.append(("opset", ", ".join(f"{domain} {version}" for domain, version in info["opset"].items())))
        ops = sorted({layer["op"] for layer in info["layers"]})
        lines.append(("group-sparse layers", f"{total['nodes']} ({', '.join(ops) or 'none'}), "
                                             f"{_size(total['bytes'])} of initializers"))
        lines.append(("initializers", f"{info['initializers']}, {_size(info['initializer_bytes'])}"))
        lines.append(("op library", info["library"] or "none (standard ONNX ops only)"))
        lines.append(("gmc", ", ".join(f"{k}={v}" for k, v in info["metadata"].items()) or "none"))
    if kind == "checkpoint":
        grouped = "" if total["grouped"] is None else f", holding {_share(total['grouped'])} of the zeros"
        lines.append(("zeros", f"{_share(total['zeros'])} of {total['params']:,} target weights; "
                               f"{_share(total['zero_groups'])} of {info['group']} groups are all zero{grouped}"))
    if info.get("provenance"):
        lines.append(("provenance", ", ".join(f"{k} {_text(v)}" for k, v in info["provenance"].items()
                                             if v is not None)))
    lines.append(("on disk", f"{_size(info['bytes_on_disk'])} in {len(info['files'])} file(s)"))
    return lines
