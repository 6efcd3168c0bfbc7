"""Lowered directories: the packed HF checkpoint of a model whose target linears run
``gmc::group_sparse_linear``, beside its lowered program.

``gmc.graph.pipeline.pack_targets`` packs the targets and ``gmc.kernels.linear`` swaps them into
the eager model (what ``model.generate``, lm-eval and ``from_pretrained`` run); the lowered program
is the graph the pass list ``LOWER`` made:

- ``save_lowered`` / ``load_lowered`` write and rebuild a lowered model: an ordinary HF checkpoint
  whose targets are packed (``gmc.formats.hf_checkpoint`` has the format), beside the lowered
  program ``program.pt2`` (and ``compiled/``, ``gmc.formats.compiled``);
- ``gmc lower`` itself (the pipeline: trace -> lowering pass -> save) is ``gmc.lower.stage``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

import torch
from torch import nn

from gmc.errors import GmcError
from gmc.formats.hf_checkpoint import (
    attach_packed_config,
    check_packed_checkpoint,
)
from gmc.graph.trace import export_logits
from gmc.kernels.linear import swap_group_sparse_linears
from gmc.kernels.packed import PackedLinear

PROGRAM_FILE = "program.pt2"  # the lowered program (torch.export.save); the packed backend writes it


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
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if program is not None:  # before the swap: the program may call modules it shares with model
        vocab = int(getattr(model.config, "vocab_size", 2))
        torch.export.save(export_logits(program, vocab), directory / PROGRAM_FILE)
    swap_group_sparse_linears(model, packed)
    attach_packed_config(model, manifest)
    model.save_pretrained(directory)  # with the refusal a process without gmc reads (attach_packed_config)
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
