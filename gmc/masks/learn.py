"""How a learned run trains (``--method groupmask | direct``): ``LearnConfig`` and its named recipes.

The run itself is ``gmc.masks.training.learn_masks``; ``--init`` offers the priors of the mask sources'
table (``gmc.masks.sources``), which is why the settings live apart from the run that the table calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gmc.config import check_at_least, check_positive, option, refuse_passed
from gmc.errors import GmcError
from gmc.formats.outputs import output_path
from gmc.masks.budget import BUDGETS
from gmc.masks.hypernet import HEADS, PAPER_OFFSET
from gmc.masks.sources import INITS
from gmc.masks.student import COMPILE_CHOICES, COMPILE_MIN_STEPS, LR_DECAYS, PRECISIONS

# Named sets of learning defaults (``--recipe``); gmc's own defaults are LearnConfig's.
RECIPES = {
    "paper": {"steps": 40000, "lr": 1e-3, "lam": 16.0, "budget": "penalty", "init": "none", "offset": PAPER_OFFSET},
}


@dataclass
class LearnConfig:
    """How a learned mask source trains (``gmc prune --method groupmask|direct``)."""

    steps: int = option(40000, "Learned: training steps.")
    batch_size: int = option(1, "Learned: sequences per step (global).")
    # measured with lambda 64 (docs/learning.md); the paper's 1e-3: --recipe paper
    lr: float = option(3e-3, "Learned: learning rate of the mask source.")
    lr_decay: str = option("none", "Learned: learning-rate decay over the steps (the mask source's and the weight "
                                   "deltas' alike). cosine: from the full rate at step 1 to nearly 0 at the last.",
                           choices=LR_DECAYS)
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.999
    # the paper's 16 reaches no budget in a CPU-sized run
    lam: float = option(64.0, "Budget term's weight (--budget schedule, penalty).", flag="--lambda")
    budget: str = option("schedule", "schedule: the penalty term towards a target sparsity that ramps (cubic) up "
                                     "over --ramp of the steps, then the exact top-k budget for the last tenth; "
                                     "topk: the selectors hold the ramped budget exactly every step; penalty: the "
                                     "paper's lambda * |log(r/r_t)| term.", choices=BUDGETS)
    ramp: float = option(0.2, "schedule/topk: fraction of --steps over which the sparsity ramps to the target.")
    init: str = option("none", "Mask prior: start the learned logits from this one-shot method's group ranking.",
                       choices=INITS)
    temperature: float = option(0.4, "Gumbel-Sigmoid temperature.")
    # measured: 4 holds the demo's six runs (3 seeds x 2 ISAs) within 9% of their median, where the paper's 3
    # spread them 20% (docs/quality.md); the paper's 3: --recipe paper
    offset: float = option(4.0, "schedule/penalty: a group is kept while its logit + offset > 0; every group "
                                "starts kept, this far clear of the threshold (the paper's: 3).")
    # measured: noise-free straight-through reaches the budget faster (docs/learning.md)
    noise: bool = option(False, "Gumbel noise in training (the export is always noise-free).")
    head: str = option("full", "Hypernetwork head: full (the paper's, 128 parameters a group) or lowrank.",
                       choices=HEADS)
    rank: int = option(16, "Rank of the lowrank head.")
    checkpoint_every: int = option(1000, "Steps between checkpoints (--recover-steps: at most 100 apart).")
    checkpoint_dir: Optional[str] = option(None, "Where checkpoints go [default: OUTPUT.ckpt].")
    resume: bool = option(False, "Continue the interrupted run from its checkpoint.")
    kd_chunk_tokens: int = 512
    layer_kd: float = option(0.0, "Learned: layer-wise distillation, the weight of a hidden-state loss beside the "
                                  "logit KD: each chosen decoder block's output against the dense model's (squared "
                                  "error relative to the teacher's, per token); 0: logit KD only.")
    layer_kd_every: int = option(1, "With --layer-kd: distil every N-th decoder block's output, counted back from "
                                    "the last block.")
    teacher_cache: bool = option(True, "Learned: keep the dense model's final hidden states per calibration block "
                                       "and rerun only the output head (memory: blocks x seq-len x hidden values).")
    precision: str = option("auto", "Learned: the GEMMs' precision. auto: bf16 on CUDA, fp32 on CPU (bf16 there is "
                                    "faster on CPUs with AVX512-BF16 or AMX). Weights, optimizer states and the loss "
                                    "stay fp32.", choices=PRECISIONS)
    compile_step: str = option("auto", f"Learned, single process: compile the student's forward and backward with "
                                       f"torch.compile (the first step compiles: about 2 minutes on 2 cores). auto: "
                                       f"on for runs of {COMPILE_MIN_STEPS}+ steps (--recover-steps "
                                       f"included).", choices=COMPILE_CHOICES)
    learn_weights: bool = option(False, "Learned: train the kept weights with the masks (a delta per target, "
                                        "--weight-lr).")
    weight_lr: float = option(1e-4, "Learned with --learn-weights: learning rate of the weight deltas (AdamW).")
    optim_8bit: bool = option(False, "bitsandbytes 8-bit AdamW (CUDA only).")
    progress: bool = True
    grad_checkpointing: bool = option(False, "torchrun: recompute each decoder layer in backward (activation "
                                             "memory of one layer).")
    fsdp_offload: bool = option(False, "torchrun on CUDA: keep the frozen weight shards in host memory.")

    def __post_init__(self):
        for name in ("steps", "batch_size", "checkpoint_every", "rank", "kd_chunk_tokens", "layer_kd_every"):
            check_at_least(f"--{name.replace('_', '-')}", getattr(self, name), 1)
        check_positive(self, "lr", "temperature", "lam", "weight_lr")
        if not (isinstance(self.offset, (int, float)) and 0.0 <= self.offset < float("inf")):
            raise GmcError(f"bad --offset {self.offset}: must be a finite number >= 0 (0: every group starts on "
                           f"the threshold)")
        if not (isinstance(self.layer_kd, (int, float)) and 0.0 <= self.layer_kd < float("inf")):
            raise GmcError(f"bad --layer-kd {self.layer_kd}: must be 0 (off) or a positive, finite weight")
        if self.checkpoint_dir is not None:
            self.checkpoint_dir = str(output_path(self.checkpoint_dir))
        if self.budget not in BUDGETS:
            raise GmcError(f"bad --budget {self.budget!r}: expected one of {', '.join(BUDGETS)}")
        if not 0.0 <= self.ramp <= 1.0:
            raise GmcError(f"bad --ramp {self.ramp}: must be a fraction of the steps in [0, 1]")
        if self.init not in INITS:
            raise GmcError(f"bad --init {self.init!r}: expected one of {', '.join(INITS)}")
        if self.compile_step not in COMPILE_CHOICES:
            raise GmcError(f"bad --compile-step {self.compile_step!r}: expected one of {', '.join(COMPILE_CHOICES)}")
        if self.lr_decay not in LR_DECAYS:
            raise GmcError(f"bad --lr-decay {self.lr_decay!r}: expected one of {', '.join(LR_DECAYS)}")
        if self.precision not in PRECISIONS:
            raise GmcError(f"bad --precision {self.precision!r}: expected one of {', '.join(PRECISIONS)}")
        if self.head not in HEADS:
            raise GmcError(f"bad --head {self.head!r}: expected one of {', '.join(HEADS)}")
        # an option of another setting would be ignored: refused ("passed": other than its default)
        if self.head != "lowrank":
            refuse_passed(self, ("rank",), "sets the lowrank head's rank: it applies with --head lowrank")
        if not self.learn_weights:
            refuse_passed(self, ("weight_lr",), "applies with --learn-weights")
        if not self.layer_kd:
            refuse_passed(self, ("layer_kd_every",), "applies with --layer-kd")
        if self.budget == "penalty":
            refuse_passed(self, ("ramp",), "does not apply to --budget penalty: it holds the full target from step 1")
        if self.budget == "topk":
            refuse_passed(self, ("lam", "offset"), "does not apply to --budget topk: it ranks the logits (no "
                                                   "penalty term, no threshold)")
