"""A model ref as the prefill/decode steps ``gmc.runtime.generate.generate`` runs: what ``gmc generate``
and ``gmc bench`` share, so their tokens and speeds come from one path.

    runnable = load_runnable(ref, dtype, device)     # the eager model, or a lowered dir's compiled packages
    with runnable.steps(max_len, compile) as run:     # run.steps, run.cache (>= max_len positions), run.how
        generate(run.steps, run.cache, ids [1, P], ...)

Loading and making the steps are two calls because the cache size often depends on the tokenizer
(prompt + new tokens), which only loading gives. A lowered directory with compiled packages
(``gmc lower --compile``) runs them, on a cache of the positions they were compiled for; anything
else runs eager (``CachedLM``), or with ``compile``: on CUDA the decode step is recorded as one CUDA
graph, on the CPU both programs are compiled with AOTInductor into a scratch directory by the path
``gmc lower --compile`` runs.
"""
from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from gmc.graph.decode import KVCache


@dataclass
class Running:
    """Steps ready for ``generate`` over their cache, and how they run."""

    steps: dict  # "prefill", "decode" -> Step
    cache: KVCache
    how: str  # "eager dense", "compiled lowered (AOTInductor, cpu)", "masks, decode as a CUDA graph", ...


@dataclass
class Runnable:
    """A loaded ref: an eager ``model``, or the ``compiled`` packages of a lowered directory."""

    kind: str  # resolve_ref's: "dense", "masks", "lowered"
    config: object  # the HF model config
    tokenizer: object  # None when the ref has none
    device: str
    model: Optional[torch.nn.Module] = None
    compiled: object = field(default=None, repr=False)  # gmc.formats.compiled.CompiledLM

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the steps read (parameters and buffers, each storage once)."""
        tensors = self.compiled.constants.values() if self.compiled is not None else \
            [*self.model.parameters(), *self.model.buffers()]
        unique = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
        return sum(unique.values())

    @contextlib.contextmanager
    def steps(self, max_len: int, compile: bool = False) -> Iterator[Running]:
        """The steps over a cache of ``max_len`` positions (compiled packages: the positions they were
        compiled for, which ``generate`` checks the prompt against)."""
        if self.compiled is not None:
            compiled = self.compiled
            cache = KVCache.empty(self.config, compiled.max_len, compiled.dtype, compiled.device)
            yield Running(compiled.steps, cache, f"compiled {self.kind} (AOTInductor, {compiled.device})")
            return
        from gmc.graph.decode import CachedLM

        model = self.model
        cache = KVCache.empty(model.config, max_len, next(model.parameters()).dtype, self.device)
        if not compile:
            step = CachedLM(model)
            yield Running({"prefill": step, "decode": step}, cache, f"eager {self.kind}")
        elif torch.device(self.device).type == "cuda":  # before the prompt: recording writes at position 0
            from gmc.runtime.cuda_graph import GraphedStep

            steps = {"prefill": CachedLM(model), "decode": GraphedStep(model, cache)}
            yield Running(steps, cache, f"{self.kind}, decode as a CUDA graph")
        else:
            from gmc.formats.compiled import load_compiled
            from gmc.graph.pipeline import lower_decode
            from gmc.lower.compile import compile_programs

            with tempfile.TemporaryDirectory(prefix="gmc-compile-") as scratch:
                compile_programs(lower_decode(model, {}, max_len), scratch, max_len)  # what `gmc lower --compile` runs
                compiled = load_compiled(scratch)
                yield Running(compiled.steps, cache, f"compiled {self.kind} (AOTInductor, {self.device})")


def load_runnable(ref: str, dtype: str, device: str, model: Optional[str] = None,
                  trust_remote_code: bool = False) -> Runnable:
    """Load ``ref`` (``gmc.runtime.refs``: a model, a masks artifact folded into its base, a lowered
    directory) once; ``model``: a masks artifact's base instead of its manifest's (``--model``).
    ``dtype`` and ``device`` are resolved ones (``device_and_dtype``); compiled packages keep their own."""
    from gmc.formats.compiled import has_compiled, load_compiled
    from gmc.runtime.refs import prepared_models, resolve_ref

    target = resolve_ref(ref, model)
    if target.kind == "lowered" and has_compiled(ref):
        from transformers import AutoConfig, AutoTokenizer

        compiled = load_compiled(ref)
        config = AutoConfig.from_pretrained(ref, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(ref, trust_remote_code=trust_remote_code)
        return Runnable(target.kind, config, tokenizer, compiled.device, compiled=compiled)
    loaded = next(prepared_models([ref], dtype, device, model, trust_remote_code))
    return Runnable(target.kind, loaded.model.config, loaded.tokenizer, device, model=loaded.model)
