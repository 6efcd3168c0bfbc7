"""The self-distillation teacher of mask learning: the dense model's logits for a step's blocks
(and, with layer-wise distillation, its hidden states after chosen decoder blocks: ``taps``).

Live: the whole graph with its selectors off, every step. Cached (the default on a graph): the
graph's trunk (everything before the output head, ``gmc.graph.head``) runs once per calibration
block, the first time a step uses the block, and its output -- the final hidden states
``[S, d]`` -- is kept; every step reruns only the head on them. It is the same function and
the same float operations per block, so with batch 1 the cached teacher's logits are the live
teacher's bit for bit; from the second epoch on a step pays the head instead of the whole dense
forward. With ``--batch-size`` above 1 the trunk still runs block by block, so a cached run is
its own bit-exact reference (resume included), within float rounding of a live one. With ``taps``
the trunk also returns those hidden states, and they are kept beside the final ones.

Memory: ``blocks x seq_len x hidden x (1 + taps)`` values in host memory (printed when the cache is made; a
cache over ``CACHE_LIMIT`` bytes is not made, and the teacher runs live, saying so);
the filled rows go to ``TEACHER_FILE`` in the checkpoint directory with each checkpoint, so a
resumed run does not recompute them. The file is loaded only when it records the same run
identity, and only as tensors (safetensors).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from torch import fx
from tqdm.auto import tqdm

from gmc.formats.atomic import atomic_write_bytes
from gmc.graph.head import split_output_head
from gmc.graph.selector import masks_disabled
from gmc.graph.taps import with_outputs
from gmc.graph.trace import attr_tensor
from gmc.masks.checkpoint import TEACHER_FILE
from gmc.masks.student import autocast

CACHE_LIMIT = 8 * 2**30  # bytes of host memory, at 4 bytes a value


class Teacher:
    """``logits(indices, batch)``: the dense logits of ``blocks[indices]`` (``batch`` on the device),
    computed under ``precision`` (``gmc.masks.student.autocast``), as the student is;
    ``outputs(indices, batch)``: those logits and the hidden states at ``taps`` (node names of ``gm``,
    ``gmc.graph.taps``)."""

    def __init__(self, gm: torch.nn.Module, blocks: torch.Tensor, device, cache: bool, precision: str,
                 directory: Optional[Path] = None, identity: Optional[dict] = None, progress: bool = False,
                 taps: Sequence[str] = ()):
        self.blocks, self.device, self.precision, self.n_taps = blocks, device, precision, len(taps)
        self.gm = with_outputs(gm, list(taps)) if taps else gm
        self.parts = split_output_head(gm, taps) if cache and isinstance(gm, fx.GraphModule) else None
        size = _cache_bytes(self.parts[1], blocks) * (1 + len(taps)) if self.parts is not None else 0
        if size > CACHE_LIMIT:
            if progress:
                tqdm.write(f"gmc: teacher cache off: {size / 2**30:.1f} GiB for "
                           f"{blocks.shape[0]} blocks is over {CACHE_LIMIT / 2**30:.0f} GiB; the teacher runs live")
            self.parts = None
        self.directory, self.progress = directory, progress
        self.identity = json.dumps(identity or {}, sort_keys=True)
        self.hidden: Optional[torch.Tensor] = None  # [n, S, d] on the host, allocated at the first block
        self.taps: Optional[torch.Tensor] = None  # [n, taps, S, d] beside it, with taps
        self.filled = torch.zeros(blocks.shape[0], dtype=torch.bool)
        self.dirty = False  # rows filled since the last save
        if self.parts is not None and directory is not None:
            self._load()

    @property
    def cached(self) -> bool:
        return self.parts is not None

    def logits(self, indices: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return self.outputs(indices, batch)[0]

    def outputs(self, indices: torch.Tensor, batch: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The logits ``[B, S, V]`` and the hidden states ``[B, S, d]`` at each tap, on the device."""
        if self.parts is None:
            with torch.no_grad(), masks_disabled(self.gm), autocast(self.device, self.precision):
                result = self.gm(batch)
            return (result[0], list(result[1:])) if self.n_taps else (result, [])
        trunk, head = self.parts
        for i in indices.tolist():
            if not self.filled[i]:
                with torch.no_grad(), masks_disabled(trunk), autocast(self.device, self.precision):
                    result = trunk(self.blocks[i:i + 1].to(self.device))
                hidden, taps = (result[0], result[1:]) if self.n_taps else (result, ())
                self._allocate(hidden[0])
                self.hidden[i] = hidden[0].cpu()
                for k, tap in enumerate(taps):
                    self.taps[i, k] = tap[0].cpu()
                self.filled[i], self.dirty = True, True
        with torch.no_grad(), autocast(self.device, self.precision):
            logits = head(self.hidden[indices].to(self.device))
        return logits, list(self.taps[indices].to(self.device).unbind(1)) if self.n_taps else []

    def save(self) -> None:
        """Write the filled rows to ``TEACHER_FILE`` (atomically), if any were filled since the last save."""
        if self.parts is None or self.directory is None or not self.dirty:
            return
        tensors = {"hidden": self.hidden, "filled": self.filled, **({"taps": self.taps} if self.n_taps else {})}
        data = save(tensors, metadata={"identity": self.identity})
        atomic_write_bytes(self.directory / TEACHER_FILE, data)
        self.dirty = False

    def _allocate(self, hidden: torch.Tensor) -> None:
        """Allocate the cache at the first block (its width and dtype are the trunk's output's)."""
        if self.hidden is not None:
            return
        n, length = self.blocks.shape
        self.hidden = torch.zeros((n, length, hidden.shape[-1]), dtype=hidden.dtype)
        if self.n_taps:
            self.taps = torch.zeros((n, self.n_taps, length, hidden.shape[-1]), dtype=hidden.dtype)
        if self.progress:
            size = self.hidden.numel() * self.hidden.element_size() * (1 + self.n_taps)
            where = f", saved with each checkpoint in {self.directory / TEACHER_FILE}" if self.directory else ""
            states = f" x {1 + self.n_taps} depths" if self.n_taps else ""
            tqdm.write(f"gmc: teacher cache: {n} blocks x {length} tokens x {hidden.shape[-1]}{states} "
                       f"{hidden.dtype} = {size / 2**20:,.0f} MiB in memory{where}")

    def _load(self) -> None:
        path = self.directory / TEACHER_FILE
        if not path.is_file():
            return
        with safe_open(str(path), "pt") as handle:
            if (handle.metadata() or {}).get("identity") != self.identity:
                return  # another run's cache: recomputed, and replaced at the next checkpoint
        state = load_file(str(path))
        hidden, filled, taps = state.get("hidden"), state.get("filled"), state.get("taps")
        if hidden is None or filled is None or tuple(filled.shape) != tuple(self.filled.shape) or \
                tuple(hidden.shape[:2]) != tuple(self.blocks.shape):
            return
        if self.n_taps and (taps is None or tuple(taps.shape) != (*hidden.shape[:1], self.n_taps, *hidden.shape[1:])):
            return
        self.hidden, self.filled, self.taps = hidden, filled.bool(), taps if self.n_taps else None


def _cache_bytes(head: fx.GraphModule, blocks: torch.Tensor) -> int:
    """Host bytes of a cache of ``blocks`` at 4 per value; the hidden size is the head weight's input size."""
    linear = next(n for n in head.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default)
    hidden = attr_tensor(head, linear.args[1].target).shape[1]
    return blocks.numel() * hidden * 4
