"""llama.cpp as a peer of gmc's compiled rows (``bench_decode.py --peer llamacpp``).

The bundled GGUF (SmolLM2-135M-Instruct, shipped as Q4_1) requantized by llama.cpp itself
(``llama_model_quantize`` with ``allow_requantize``) to each of ``FORMATS``, each behind gmc's
step signature ``(ids, position, keys, values) -> logits [1, vocab]`` so that ``bench_decode.py``
times it in the same interleaved loops as its own rows (gmc's KV cache arguments are ignored:
llama.cpp keeps its own). Held-out perplexity goes through llama.cpp's logits on the token ids
gmc's tokenizer gives, over gmc's windows (``gmc.runtime.evaluate.perplexity_windows``).

Needs ``pip install -e '.[peer]'``: llama-cpp-python from the registry's source distribution,
whose version the rows use. The rows never run the installed build itself, whose flags are
whatever the machine that built its wheel had: each -march has a build of that version made here
with pip at first use (``use_build``, about 8 minutes on 2 cores, once) into
``$GMC_CACHE/llamacpp-MARCH/site`` and put ahead of the installed one. ``native`` is llama.cpp's
own ``GGML_NATIVE=ON`` (every instruction set this CPU has); ``bench_decode.py --march x86-64-v3``
runs llama.cpp built for AVX2 alone (``GGML_NATIVE=OFF``, AVX2/FMA/F16C on, every AVX-512,
AVX-VNNI and AMX option off): ``CMAKE_FLAGS``.
"""
from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

FORMATS = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
PRECISION = {"F32": "fp32", "F16": "fp16", "Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}


# CMake options of llama.cpp's build for each -march (llama-cpp-python's CMAKE_ARGS)
CMAKE_FLAGS = {"native": "-DGGML_NATIVE=ON",
               "x86-64-v3": ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                             "-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF "
                             "-DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
                             "-DGGML_AMX_BF16=OFF")}


def use_build(march: str) -> None:
    """Import llama.cpp built for ``march`` from now on: a build of the installed version with
    ``CMAKE_FLAGS[march]`` (pip, about 8 minutes on 2 cores, once)."""
    import importlib.metadata

    if march not in CMAKE_FLAGS:
        raise SystemExit(f"peer_llamacpp: no llama.cpp build for -march={march}; known: {', '.join(CMAKE_FLAGS)}")
    from gmc.config import cache_root

    site = cache_root() / f"llamacpp-{march}" / "site"
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return  # not installed: available() says so
    if not (site / f"llama_cpp_python-{version}.dist-info").is_dir():
        print(f"peer_llamacpp: building llama-cpp-python {version} for {march} into {site} (about 8 minutes)",
              file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--no-deps", "--no-binary",
                               "llama-cpp-python", "--target", str(site), f"llama-cpp-python=={version}"],
                              env={**os.environ, "CMAKE_ARGS": CMAKE_FLAGS[march]}, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"peer_llamacpp: building llama.cpp for {march} failed: "
                             f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    sys.path.insert(0, str(site))


def system_info() -> str:
    """The instruction sets the loaded llama.cpp was built for (``llama_print_system_info``)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def requantized(fmt: str) -> Path:
    """``$GMC_CACHE/llamacpp/smollm2-135m-<fmt>.gguf``, written by llama.cpp from the bundled file
    once (named by the bundled file's size and llama-cpp-python's version)."""
    import llama_cpp

    from gmc.config import cache_root
    from gmc.inputs.model import smollm2_gguf_path

    source = smollm2_gguf_path()
    directory = cache_root() / "llamacpp"
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"smollm2-135m-{source.stat().st_size}-{llama_cpp.__version__}-{fmt}.gguf"
    if not target.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_ALL_F32" if fmt == "F32" else f"LLAMA_FTYPE_MOSTLY_{fmt}")
        params.allow_requantize = True
        partial = target.with_suffix(".partial")
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(),
                                                ctypes.byref(params))
        if status != 0:
            raise RuntimeError(f"llama_model_quantize to {fmt} failed with status {status}")
        partial.rename(target)
    return target


def tensor_types(path: Path) -> dict[str, str]:
    """``{tensor type: bytes}`` summary of a GGUF file, and the output head's type (``token_embd``:
    SmolLM2 ties it)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    types = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    head = next(t.tensor_type.name for t in reader.tensors if t.name in ("output.weight", "token_embd.weight"))
    return {"types": types, "head": head, "bytes": sum(types.values())}


class LlamaCppSteps:
    """One llama.cpp context as gmc's prefill and decode steps."""

    def __init__(self, path: Path, n_ctx: int, threads: int, logits_all: bool = False):
        import llama_cpp

        self.logits_all = logits_all
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, logits_all=logits_all, verbose=False)

    def _last_logits(self, batch: int) -> torch.Tensor:
        """The last token's logits: without logits_all llama-cpp-python stores none of them in
        ``scores``, so they are read from the context (the one row the batch asked for)."""
        import llama_cpp

        if self.logits_all:
            return torch.from_numpy(np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32))[None]
        row = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(row, shape=(self.llm.n_vocab(),)).copy())[None]

    def prefill(self, ids: torch.Tensor, position, keys=None, values=None) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(ids[0].tolist())
        return self._last_logits(ids.shape[1])

    def decode(self, ids: torch.Tensor, position, keys=None, values=None) -> torch.Tensor:
        self.llm.eval(ids[0].tolist())
        return self._last_logits(ids.shape[1])

    def steps(self) -> dict:
        return {"prefill": self.prefill, "decode": self.decode}

    def close(self) -> None:
        """Free the model now: llama-cpp-python's own finaliser fails at interpreter exit."""
        self.llm.close()


def heldout_ppl(path: Path, tokenizer, seq_len: int, threads: int) -> float:
    """Perplexity on the bundled held-out text through llama.cpp's logits: gmc's token ids, gmc's
    windows, each window's tokens scored as ``gmc.runtime.evaluate`` scores them."""
    from gmc.runtime.evaluate import load_document, perplexity_windows

    text, _ = load_document("bundled-heldout")
    ids = tokenizer(text)["input_ids"]
    model = LlamaCppSteps(path, seq_len, threads, logits_all=True)
    total, scored = 0.0, 0
    for begin, first in perplexity_windows(len(ids), seq_len):
        window = ids[begin: begin + seq_len]
        model.llm.reset()
        model.llm.eval(window)
        logits = torch.from_numpy(np.array(model.llm.scores[: len(window)], dtype=np.float32)).double()
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(window[1:]), reduction="none")
        keep = torch.arange(1, len(window)) >= first - begin
        total += float(nll[keep].sum())
        scored += int(keep.sum())
    model.close()
    return math.exp(total / scored)
