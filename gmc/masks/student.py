"""How the student of a distillation run computes and updates: its forward compiled or eager
(``Student``; ``compiles_step``: when a learned run compiles it), the precision of its GEMMs
(``PRECISIONS``, ``autocast``), its optimizer (``adamw``) and its learning-rate decay (``lr_scale``).
Mask learning and weight recovery share them."""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from gmc.errors import GmcError

PRECISIONS = ("auto", "bf16", "fp32")
COMPILE_CHOICES = ("auto", "on", "off")
# --compile-step auto compiles runs this long: a cold compile costs about what 200 compiled steps save
# (2 CPU-minutes against 0.6 CPU-s a step, bundled SmolLM2 on 2 cores; docs/learning.md)
COMPILE_MIN_STEPS = 400


def resolve_precision(precision: str, device) -> str:
    """``auto``: bf16 on CUDA, fp32 on CPU. ``bf16`` on a CPU with native bf16 dot products (AVX512-BF16,
    AMX) makes a run 1.37x cheaper, but over four seeds on the bundled SmolLM2 it diverged once
    (1,616.74 held-out against fp32's 344.04) and matched fp32 on the others (docs/learning.md)."""
    if precision != "auto":
        return precision
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def autocast(device, precision: str):
    """bf16 autocast of the forward's GEMMs (``precision`` ``bf16``, or ``auto`` resolved), else fp32.
    Weights, optimizer states and the loss stay fp32."""
    device = torch.device(device)
    enabled = resolve_precision(precision, device) == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class Student:
    """``student(batch)``: the model's forward, compiled by Inductor (``torch.compile``: forward and
    backward, their elementwise work fused around the GEMMs) or eager.

    The first compiled call compiles (minutes on a small CPU; Inductor's cache makes a rerun on the
    same machine quicker); if compiling fails -- no C++ compiler, an unsupported op -- the run
    continues eager and says why. Compiled and eager steps give the same gradients to float
    rounding (tests/masks/test_learn.py), not bit for bit, so the choice is part of a run's identity.
    """

    def __init__(self, model: torch.nn.Module, compiled: bool):
        self.model = model
        self.compiled = torch.compile(model) if compiled else None

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            try:
                return self.compiled(batch)
            except Exception as error:  # noqa: BLE001 - any compile failure falls back to eager
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                tqdm.write(f"gmc: compiling the training step failed ({first[:200]}); running it eager")
                self.compiled = None
        return self.model(batch)


def compiles_step(learn, dist, recover_steps: int = 0) -> bool:
    """Whether the student's step is compiled (``learn``: a ``LearnConfig``): ``--compile-step``, with
    ``auto`` on for runs of ``COMPILE_MIN_STEPS`` steps, counting the ``recover_steps`` that continue on
    the learned graph (``--recover-steps``: they reuse its compiled step); a torchrun launch (``dist``
    given) runs it eager."""
    if dist is not None or learn.compile_step == "off":
        return False
    return learn.compile_step == "on" or learn.steps + recover_steps >= COMPILE_MIN_STEPS


LR_DECAYS = ("none", "cosine")


def lr_scale(step: int, steps: int, decay: str) -> float:
    """The learning rate of ``step`` (1-based) of ``steps`` as a fraction of the configured one.

    ``none``: 1 throughout. ``cosine``: ``(1 + cos(pi * (step - 1) / steps)) / 2``, from 1 at the first
    step to nearly 0 at the last, so the landing steps move the logits (and weight deltas) little.
    """
    if decay == "none":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * (step - 1) / steps))


def adamw(params, device, optim_8bit: bool, **kwargs) -> torch.optim.Optimizer:
    """AdamW over ``params``, or bitsandbytes' 8-bit AdamW (CUDA only) with ``optim_8bit``."""
    if optim_8bit:
        if torch.device(device).type != "cuda":
            raise GmcError("--optim-8bit needs a CUDA device (bitsandbytes); drop it on CPU")
        try:
            import bitsandbytes as bnb
        except ImportError as error:
            raise GmcError("--optim-8bit needs bitsandbytes: pip install 'gmc[bnb]'") from error
        return bnb.optim.AdamW8bit(params, **kwargs)
    params = list(params)
    # fused: one pass over each tensor, where the default CPU AdamW makes a dozen (0.09 vs 1.0 s a step on
    # SmolLM2's 212M-parameter head, 2 threads, AMD EPYC); sharded (DTensor) parameters keep the default
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    fused = all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point() for t in tensors)
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)
