"""onnxruntime-genai rows of ``bench_genai.py``: ONNX model directories behind gmc's step signature.

Rows, each an ONNX model directory run by onnxruntime-genai's generator (its own KV cache) behind
gmc's step signature (``gmc.runtime.bench.GenaiStep``), so ``bench_genai.py`` times them in
``bench_decode.py``'s loops:

- ``onnxruntime-genai fp32`` / ``int4``: the runtime's own model builder on the dense model
  (``python -m onnxruntime_genai.models.builder -p fp32|int4 -e cpu``; int4 is ``MatMulNBits``,
  block 32, int8 activations, the output head 4-bit too); ``int4, head int8``: the same with the
  builder's ``matmul_mixed_precision=last_matmul:int8`` (``EXPORTS``), gmc's and llama.cpp's head
  precision;
- ``gmc onnx lowered`` (+ ``int4``, ``standard ops``): ``gmc lower --backend onnx`` of the bench's
  masks (the same builder graph, each pruned MatMul on gmc's op; the head int8 under int4).

Held-out perplexity goes through the directory's logits over gmc's token ids and windows
(``gmc.runtime.evaluate.perplexity_windows``), one ``onnxruntime`` session call a window from an
empty cache, as ``peer_llamacpp.heldout_ppl`` does for llama.cpp.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from gmc.lower.backends.onnx import model_builder


def available() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


# The builder's exports as rows: label suffix -> (its precision, its extra options)
HEAD_INT8 = "matmul_mixed_precision=last_matmul:int8"
EXPORTS = {"fp32": ("fp32", ()), "int4": ("int4", ()), "int4, head int8": ("int4", (HEAD_INT8,))}


def builder_export(hf_dir: Path, export: str, scratch: Path) -> Path:
    """The model builder's CPU export ``export`` (a key of ``EXPORTS``) of ``hf_dir`` under ``scratch``.
    An int8 head is exported from an untied copy (``untied``)."""
    precision, options = EXPORTS[export]
    out = scratch / ("genai-" + export.replace(", ", "-").replace(" ", "-"))
    if not (out / "genai_config.json").is_file():
        source = untied(hf_dir, scratch / "hf-untied") if HEAD_INT8 in options else hf_dir
        model_builder(source, out, scratch / "genai-cache", precision, options)
    return out


def untied(hf_dir: Path, out: Path) -> Path:
    """``hf_dir`` with the output head holding its own copy of a tied embedding (the same numbers):
    on a tied model the builder's int8 head names a weight it never writes, and onnxruntime refuses
    the graph (onnxruntime-genai 0.18.0)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not AutoConfig.from_pretrained(hf_dir).tie_word_embeddings:
        return hf_dir
    if not (out / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(hf_dir)
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out)
    return out


def weight_bytes(directory: Path) -> int:
    """Bytes a decode step reads: every initializer but the embedding table, which only ``Gather``
    reads (through a ``Transpose`` where the builder ties it to the head: folded when a session opens)."""
    import onnx

    model = onnx.load(str(directory / "model.onnx"), load_external_data=False)
    consumers: dict[str, set] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    total = 0
    for tensor in model.graph.initializer:
        if consumers.get(tensor.name, set()) <= {"Gather", "Transpose"}:
            continue
        count = math.prod(tensor.dims)
        total += count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return total


def heldout_ppl(directory: Path, tokenizer, seq_len: int, threads: int) -> float:
    """Perplexity on the bundled held-out text through the directory's logits: gmc's token ids and
    windows, each window one session call from an empty cache."""
    from gmc.formats.onnx import onnx_session
    from gmc.runtime.evaluate import load_document, perplexity_windows

    text, _ = load_document("bundled-heldout")
    ids = tokenizer(text)["input_ids"]
    session = onnx_session(directory, threads)
    config = json.loads((directory / "genai_config.json").read_text())["model"]["decoder"]
    empty = np.zeros((1, config["num_key_value_heads"], 0, config["head_size"]), np.float32)
    pasts = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values")]
    total, scored = 0.0, 0
    for begin, first in perplexity_windows(len(ids), seq_len):
        window = ids[begin: begin + seq_len]
        feeds = {"input_ids": np.array([window], np.int64), "attention_mask": np.ones((1, len(window)), np.int64),
                 **{name: empty for name in pasts}}
        logits = torch.from_numpy(session.run(["logits"], feeds)[0][0]).double()  # [S, V]
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(window[1:]), reduction="none")
        keep = torch.arange(1, len(window)) >= first - begin
        total += float(nll[keep].sum())
        scored += int(keep.sum())
    return math.exp(total / scored)
