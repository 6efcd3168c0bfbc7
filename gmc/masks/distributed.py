"""Mask learning across devices and machines: ``torch.distributed`` + FSDP2, launched by torchrun.

    torchrun --nproc-per-node 8 -m gmc prune meta-llama/Llama-2-13b-hf --sparsity 0.5 -o runs/13b

``gmc prune`` sees ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in its environment and runs
``gmc.masks.prune_distributed``: init the process group (gloo on CPU, nccl on CUDA) -> every rank
reads the calibration text and loads the model (failures are exchanged, so one rank's failure is
one error on all) -> selectors attached to the eager model (``gmc.graph.selector.attach_selectors``)
-> FSDP2 per decoder layer -> ``learn_masks`` -> rank 0 writes the artifact. This module holds the
mechanics of distribution (the process group, ``Dist``'s collectives, sharding); the order of the
steps is ``gmc.masks.prune_distributed``'s, and the learning step is ``gmc.masks.training``'s.

Design answers (docs/scaling.md has the memory model behind them):

* **Eager model, not the exported graph.** FSDP2 ``fully_shard`` needs module boundaries per
  decoder layer; the flat ``ep.module()`` graph has none. ``torch.export.unflatten`` rebuilds a
  hierarchy of ``InterpreterModule``s and ``fully_shard`` does apply to it (checked on CPU/gloo,
  torch 2.13), but selectors would have to be re-inserted into one sub-graph per linear, every
  rank would have to export the full model first, and unflatten is a prototype API with its own
  rules for aliased (tied) parameters. Instead each target ``nn.Linear`` keeps its class and its
  parameters, and its ``forward`` becomes a call of a ``GroupSelector`` on the linear's *current*
  ``weight`` (FSDP2 swaps in the all-gathered tensor before the layer runs). It is the same
  ``GroupSelector``/``masked_linear`` (lean backward) as the graph path, fed the same tensors
  by the same aten ops, so the math is the same; the tests compare the learned selectors with a
  single-process graph run. Decoder layers (the children of the ``ModuleList`` that holds the
  targets) are ``fully_shard``-ed one by one, then the root (embeddings, norm, lm_head).
  Activation checkpointing uses the composable ``torch.distributed._composable.checkpoint``
  (non-reentrant, FSDP2-compatible, keeps parameter names).
* **Hypernetwork replicated; the all-reduce is on the selector-logit gradients.** Every rank holds
  the same hypernetwork (same seed) and computes the same logits and hard selectors, so nothing is
  broadcast. Backward stops at the logits: each rank all-reduces ``dKD/dlogits`` (one float per
  group: 25M for LLaMA-2-7B at 1x256, 101 MB) instead of the hypernetwork gradients (128 floats per
  group for the paper's head), adds the budget-regulariser gradient once, and backpropagates the
  identical total through its replica, so every replica takes the identical AdamW step. Heads are
  not sharded, because up to ~14B parameters a replica fits next to the sharded model: the paper's
  3.2B-parameter head for LLaMA-2-7B at 1x256 costs 51.8 GB with fp32 AdamW (32.4 GB with 8-bit
  states), gmc's rank-16 head 6.5 GB (docs/scaling.md). At 70B even the rank-16 head is 68.5 GB per
  replica: sharding the heads by target is the next step, and reuses this exchange (all-gather the
  logits, reduce-scatter their gradients).
* **Global batch, fixed split.** Step ``k`` uses ``batch_indices(k, B, ...)`` and rank ``r`` takes
  the ``r``-th contiguous slice of ``B / W`` sequences; KD is normalised by global tokens (each
  rank's mean is weighted by its share of tokens before the sum), the regulariser is counted once,
  so results depend on ``W`` only through floating-point reduction order.
* **Checkpoints.** The trained state (hypernetwork, optimizer, step) is replicated, so rank 0
  writes it atomically and sends it to the other ranks on resume (no shared file system needed).
  The run identity holds no world-size field: a run can resume with another world size, exactly
  up to reduction order; same world size resumes bit for bit.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
from torch import nn

from gmc.errors import GmcError
from gmc.graph.selector import GroupSelector

T = TypeVar("T")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher with its contract) started this process."""
    return all(name in os.environ for name in TORCHRUN_VARS)


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class Dist:
    """This process's place in a data-parallel run: the collectives the learner needs."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place."""
        torch.distributed.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        torch.distributed.barrier()

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only and give every rank its result (or its GmcError)."""
        box = [None]
        if self.main:
            try:
                box[0] = ("ok", fn())
            except GmcError as error:
                box[0] = ("error", str(error))
        torch.distributed.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise GmcError(value)
        return value

    def on_all(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` on every rank; if any rank fails, every rank raises one GmcError."""
        try:
            value, failure = fn(), None
        except GmcError as error:
            value, failure = None, str(error)
        failures = [None] * self.world_size
        torch.distributed.all_gather_object(failures, failure)
        failed = [(rank, message) for rank, message in enumerate(failures) if message is not None]
        if failed:
            rank, message = failed[0]
            where = "every rank" if len(failed) == self.world_size else f"rank {rank} of {self.world_size}"
            raise GmcError(f"{what} failed on {where}: {message}")
        return value


@contextlib.contextmanager
def process_group(device: str):
    """Initialise the default process group for this torchrun worker; destroy it on exit."""
    import torch.distributed as dist

    rank, world_size, local_rank = (int(os.environ[name]) for name in TORCHRUN_VARS)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise GmcError(f"--device {device} but CUDA is not available on rank {rank}")
        torch_device = torch.device("cuda", local_rank)
        torch.cuda.set_device(torch_device)
        backend = "nccl"
    elif device == "cpu":
        torch_device, backend = torch.device("cpu"), "gloo"
    else:
        raise GmcError(f"--device {device} is not supported under torchrun: use cpu or cuda")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend)
    try:
        yield Dist(rank, world_size, torch_device)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


@torch.no_grad()
def execution_order(model: nn.Module, selectors: dict[str, GroupSelector], device) -> list[str]:
    """Target names in the order a forward runs them (the graph order the hypernetwork uses)."""
    order = []
    for name, selector in selectors.items():
        selector.observer = lambda x, name=name: order.append(name)
    try:
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
    finally:
        for selector in selectors.values():
            selector.observer = None
    return list(dict.fromkeys(order))


def shard_model(model: nn.Module, layers: list[nn.Module], dist: Dist, grad_checkpointing: bool = False,
                offload: bool = False) -> nn.Module:
    """FSDP2: each decoder layer, then the root; optional activation checkpointing and offload.

    On CUDA an fp32 model is all-gathered and run in bf16 (``MixedPrecisionPolicy``); load with
    ``--dtype bfloat16`` to also halve the stored shards.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if offload and dist.device.type != "cuda":
        raise GmcError("--fsdp-offload moves frozen weights from the accelerator to host memory; "
                       "with --device cpu they already are there: drop it")
    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    dtype = next(model.parameters()).dtype
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if (
        dist.device.type == "cuda" and dtype == torch.float32) else MixedPrecisionPolicy()
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    if grad_checkpointing:
        from torch.distributed._composable import checkpoint

        for layer in layers:
            checkpoint(layer)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mixed, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mixed, offload_policy=policy)
    return model
