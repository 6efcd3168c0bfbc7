"""ONNX model directories (``gmc lower --backend onnx``): what onnxruntime-genai loads and generates from.

    model.onnx, model.onnx.data   the decoder: input_ids, attention_mask, past_key_values.N.key/value in,
                                  logits and present.N.key/value out (onnxruntime-genai's layout)
    genai_config.json             the runtime's configuration; with the custom op its decoder session
                                  options name libgmc_ort_ops.so, which lies beside it
    libgmc_ort_ops.so, .json      gmc's ONNX Runtime op library and its stamp (gmc.kernels.ort_ops)
    tokenizer files               from the model builder
    gmc_onnx.json                 what gmc made: pattern, quantization, op form, layer counts, provenance

Reading a directory (``check_onnx_dir``) runs nothing: the config must parse, the model file must
parse as ONNX, and a custom-op library must be a file inside the directory whose stamp says gmc built
it for this host (``gmc.kernels.ort_ops.check_library``) -- a library is code, and gmc loads only
what it can tell it built. Each refusal is one line.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Mapping, Optional

from gmc.errors import GmcError
from gmc.formats.atomic import atomic_dir

MODEL_FILE, DATA_FILE = "model.onnx", "model.onnx.data"
GENAI_CONFIG = "genai_config.json"
METADATA_FILE = "gmc_onnx.json"
LIBRARY_KEY = "custom_ops_library"  # in genai_config's model.decoder.session_options


def is_onnx_dir(path: Path) -> bool:
    return path.is_dir() and (path / GENAI_CONFIG).is_file()


def save_onnx_dir(model, builder_dir: Path, output: str | os.PathLike, library: Optional[Path],
                  metadata: Mapping, overwrite: bool = False) -> Path:
    """Write ``model`` (an ``onnx.ModelProto``) with the builder's other files from ``builder_dir``
    at ``output``, atomically; with ``library`` (gmc's op library) copied in and named by the config."""
    import onnx

    with atomic_dir(output, "onnx", overwrite) as tmp:
        for item in builder_dir.iterdir():
            if item.is_file() and item.name not in (MODEL_FILE, DATA_FILE, GENAI_CONFIG):
                shutil.copy2(item, tmp / item.name)
        onnx.save_model(model, str(tmp / MODEL_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=DATA_FILE, size_threshold=1024)
        config = json.loads((builder_dir / GENAI_CONFIG).read_text())
        options = config["model"]["decoder"].setdefault("session_options", {})
        if library is not None:
            from gmc.kernels.ort_ops import STAMP

            for source in (library, library.with_name(STAMP)):
                shutil.copy2(source, tmp / source.name)
            options[LIBRARY_KEY] = library.name
        (tmp / GENAI_CONFIG).write_text(json.dumps(config, indent=4) + "\n")
        (tmp / METADATA_FILE).write_text(json.dumps(dict(metadata), indent=2) + "\n")
    return Path(output)


def check_onnx_dir(path: str | os.PathLike) -> dict:
    """The parsed ``genai_config.json`` of an ONNX model directory, after the checks above; the
    checked model file as ``config["gmc_model"]`` and the library (when one is named) as
    ``config["gmc_library"]``, absolute paths."""
    path = Path(path)
    if not is_onnx_dir(path):
        raise GmcError(f"{path} is not an ONNX model directory: it has no {GENAI_CONFIG} "
                       "(gmc lower --backend onnx writes one)")
    try:
        config = json.loads((path / GENAI_CONFIG).read_text())
        decoder = config["model"]["decoder"]
        filename = decoder.get("filename", MODEL_FILE)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise GmcError(f"{path / GENAI_CONFIG} is not a valid onnxruntime-genai config ({error})") from None
    config["gmc_model"] = _inside(path, filename, "model file")
    _check_model_file(config["gmc_model"])
    library = decoder.get("session_options", {}).get(LIBRARY_KEY)
    if library:
        library_path = _inside(path, library, LIBRARY_KEY)
        from gmc.kernels.ort_ops import check_library

        check_library(library_path)
        config["gmc_library"] = library_path
    return config


def _inside(directory: Path, name: str, what: str) -> Path:
    """``directory / name`` when it is a file inside ``directory`` (no link, no ``..``, no absolute path)."""
    candidate = Path(name)
    resolved = (directory / candidate).resolve()
    if candidate.is_absolute() or ".." in candidate.parts or directory.resolve() not in resolved.parents:
        raise GmcError(f"{directory / GENAI_CONFIG} names the {what} {name!r} outside the model directory: gmc "
                       f"loads only files inside {directory}")
    if not resolved.is_file():
        raise GmcError(f"{directory} has no {what} {name!r}: the directory is incomplete; lower it again")
    return resolved


def _check_model_file(model_path: Path) -> None:
    """The model file parses as ONNX (its graph, not its weights: those stay on disk)."""
    import onnx

    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as error:  # protobuf's DecodeError and friends: one line
        raise GmcError(f"{model_path} is not a readable ONNX model ({type(error).__name__}): "
                       "the file is corrupted; lower it again") from None
    if not len(model.graph.node):
        raise GmcError(f"{model_path} holds no graph: the file is corrupted; lower it again")


def genai_model(path: str | os.PathLike, threads: Optional[int] = None):
    """``onnxruntime_genai.Model`` of a checked directory (``threads``: its intra-op threads)."""
    import onnxruntime_genai as og

    check_onnx_dir(path)
    config = og.Config(str(path))
    if threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    return og.Model(config)


def onnx_session(path: str | os.PathLike, threads: Optional[int] = None):
    """An ``onnxruntime.InferenceSession`` of a checked directory's decoder, gmc's op library registered
    when the directory names it (for logits over whole windows: perplexity)."""
    import onnxruntime as ort

    config = check_onnx_dir(path)
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    if "gmc_library" in config:
        from gmc.kernels.ort_ops import register

        register(options, config["gmc_library"])
    return ort.InferenceSession(str(config["gmc_model"]), options, providers=["CPUExecutionProvider"])
