"""Mask learning across devices and machines: ``torch.distributed`` + FSDP2, launched by torchrun.

    torchrun --nproc-per-node 8 -m gmc prune meta-llama/Llama-2-13b-hf --sparsity 0.5 -o runs/13b

``gmc prune`` sees ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in its environment and runs
``prune_distributed``: init the process group (gloo on CPU, nccl on CUDA) -> every rank reads the
calibration text and loads the model (failures are exchanged, so one rank's failure is one error
on all) -> selectors attached to the eager model -> FSDP2 per decoder layer -> ``learn_masks`` ->
rank 0 writes the artifact.

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
from typing import Callable, Optional, TypeVar

import torch
from torch import nn

from gmc.errors import GmcError
from gmc.groups import Pattern
from gmc.passes.find_targets import DEFAULT_TARGETS, _NEVER, Target, _compile
from gmc.selector import GroupSelector

T = TypeVar("T")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SELECTOR_ATTR = "gmc_selector"


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


def eager_targets(model: nn.Module, include: Optional[str], ignore: Optional[str]) -> list[Target]:
    """Target linears of the eager model, by the rules of ``find_targets`` (module order)."""
    include_re = _compile(include or DEFAULT_TARGETS, "--include")
    ignore_re = _compile(ignore, "--ignore")
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or _NEVER.search(name) or not include_re.search(name):
            continue
        if ignore_re is not None and ignore_re.search(name):
            continue
        targets.append(Target(name, tuple(module.weight.shape), None))
    if not targets:
        raise GmcError(f"no target linears found in {type(model).__name__} "
                       f"(include={include or DEFAULT_TARGETS!r}, ignore={ignore!r})")
    return targets


def attach_selectors(model: nn.Module, targets: list[Target], pattern: Pattern) -> dict[str, GroupSelector]:
    """Route each target linear through a ``GroupSelector``; return them keyed by target name.

    The linear keeps its class, parameters and state-dict keys; the selector (no parameters) is a
    child module, so FSDP2 leaves it alone, and it reads ``weight`` at call time, after FSDP2 has
    all-gathered it.
    """
    selectors = {}
    for target in targets:
        linear = model.get_submodule(target.name)
        selector = GroupSelector(target.name, pattern, target.shape)
        linear.add_module(SELECTOR_ATTR, selector)
        linear.forward = _selected_forward(linear, selector)
        selectors[target.name] = selector
    return selectors


def _selected_forward(linear: nn.Linear, selector: GroupSelector):
    def forward(x):
        return selector(x, linear.weight, linear.bias)

    return forward


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


def decoder_layers(model: nn.Module, targets: list[Target]) -> list[nn.Module]:
    """The children of a ``ModuleList`` that contain targets: the units FSDP2 shards."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for index, child in enumerate(module):
                prefix = f"{name}.{index}."
                if any(t.name.startswith(prefix) for t in targets):
                    layers[prefix] = child
    if not layers:
        raise GmcError(f"no decoder layers (ModuleList children) hold the targets of {type(model).__name__}")
    return list(layers.values())


def shard_model(model: nn.Module, layers: list[nn.Module], dist: Dist, grad_checkpointing: bool = False,
                offload: bool = False) -> nn.Module:
    """FSDP2: each decoder layer, then the root; optional activation checkpointing and offload.

    On CUDA an fp32 model is all-gathered and run in bf16 (``MixedPrecisionPolicy``); load with
    ``--dtype bfloat16`` to also halve the stored shards.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

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


class LogitsOnly(nn.Module):
    """``input_ids -> logits`` of the sharded eager model (the graph path's signature)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def check_config(config, world_size: int) -> None:
    """What a distributed run refuses, checked before any collective or model load."""
    from gmc.prune import LEARNED_METHODS

    if config.method not in LEARNED_METHODS:
        raise GmcError(f"--method {config.method} does not run under torchrun: only the learned methods "
                       f"({', '.join(LEARNED_METHODS)}) are distributed; run it as a single process")
    batch = config.learn.batch_size
    if batch % world_size:
        raise GmcError(f"world size {world_size} does not divide --batch-size {batch}: the global batch is "
                       f"split evenly across ranks; use a multiple of {world_size}")
    if config.save_dense:
        raise GmcError("--save-dense is not available under torchrun (the model is sharded): write the "
                       "artifact, then fold it in a single process")


def prune_distributed(config):
    """``prune`` for a torchrun worker: returns the artifact on rank 0 and None on the others."""
    from gmc.artifact import MaskArtifact, build_manifest, save_artifact
    from gmc.learn import learn_masks, remove_checkpoint
    from gmc.model import load_model, model_fingerprint
    from gmc.prune import calib_lines, calibration_blocks

    check_config(config, int(os.environ["WORLD_SIZE"]))
    with process_group(config.device) as dist:
        lines = dist.on_all(lambda: calib_lines(config), "reading the calibration text")
        # every rank loads the full model on the host; fully_shard then keeps 1/W of it
        loaded = dist.on_all(lambda: load_model(config.model, config.dtype, "cpu", config.trust_remote_code),
                             f"loading {config.model}")
        fingerprint = model_fingerprint(loaded.model)
        blocks, calibration = calibration_blocks(config, loaded, lines)
        model = loaded.model
        targets = eager_targets(model, config.include, config.ignore)
        selectors = attach_selectors(model, targets, config.pattern)
        layers = decoder_layers(model, targets)
        shard_model(model, layers, dist, config.learn.grad_checkpointing, config.learn.fsdp_offload)
        by_name = {t.name: t for t in targets}
        targets = [by_name[name] for name in execution_order(model, selectors, dist.device)]
        selectors = {t.name: selectors[t.name] for t in targets}
        shapes = {t.name: t.shape for t in targets}
        result = learn_masks(LogitsOnly(model), targets, config, blocks, fingerprint,
                             selectors=selectors, dist=dist)
        artifact = None
        if dist.main:
            manifest = build_manifest(
                model_ref=loaded.ref, fingerprint=fingerprint, pattern=config.pattern, masks=result.masks,
                shapes=shapes, method=config.method, allocation=config.allocation,
                target_sparsity=config.sparsity, calibration=calibration, seed=config.seed,
                nsamples=int(blocks.shape[0]), seq_len=int(blocks.shape[1]), **result.manifest,
            )
            artifact = MaskArtifact(result.masks, manifest, {})
            save_artifact(config.output, artifact, result.files, overwrite=config.overwrite)
            remove_checkpoint(result.checkpoint_dir)  # only once the artifact is in place
        dist.barrier()  # no rank leaves (and tears the group down) before the artifact exists
    return artifact

