"""A decode step as one CUDA graph: every kernel of a token launched by a single replay.

A batch-1 decode step of an LLM is hundreds of small kernels (for a 7B Llama: seven products, two
norms, rotary, attention and their glue in each of 32 layers); launched one by one from Python, the
launch gaps cost more than a lowered model's kernels take. ``GraphedStep`` records one step of a
``CachedLM(model, static=True)`` once and replays it: the token and the position are copied into
the graph's own input tensors, the cache is the caller's (the graph reads and writes it in place),
and the logits come back in the graph's output tensor. A static step reads all cache slots under a
mask made on the device from the position, so no shape or address changes from token to token and
nothing is read back to the host (``gmc.graph.decode``).

Recording runs the step (twice to warm up, then once captured) at position 0 of the caller's
cache; ``gmc.runtime.generate`` records before the prompt is written, so the prompt overwrites it.
"""
from __future__ import annotations

import torch

from gmc.errors import GmcError
from gmc.graph.decode import CachedLM, KVCache


class GraphedStep:
    """``step(token [1, 1], position [], keys, values) -> logits [1, V]`` replaying a recorded CUDA graph."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, warmup: int = 2):
        device = cache.keys[0].device
        if device.type != "cuda":
            raise GmcError(f"a CUDA graph needs the model and cache on a CUDA device, got {device}")
        step = CachedLM(model, static=True)
        self.keys, self.values = cache.keys, cache.values
        self.token = torch.zeros((1, 1), dtype=torch.long, device=device)  # [1, 1]
        self.position = torch.zeros((), dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.stream(side):  # first calls compile kernels, make handles: not recorded
            for _ in range(warmup):
                step(self.token, self.position, self.keys, self.values)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.logits = step(self.token, self.position, self.keys, self.values)  # [1, V], the graph's own

    def __call__(self, token: torch.Tensor, position: torch.Tensor, keys, values) -> torch.Tensor:
        if keys is not self.keys or values is not self.values:
            raise GmcError("a graphed step runs on the cache it was recorded with")
        self.token.copy_(token)
        self.position.copy_(position)
        self.graph.replay()
        return self.logits
