"""How a learned run trains (``--method groupmask | direct``): ``LearnConfig`` and its named recipes.

The run itself is ``gmc.masks.training.learn_masks``; ``--init`` offers the priors of the mask sources'
table (``gmc.masks.sources``), which is why the settings live apart from the run that the table calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gmc.config import check_at_least, check_positive, refuse_passed
from gmc.errors import GmcError
from gmc.formats.outputs import output_path
from gmc.masks.budget import BUDGETS
from gmc.masks.hypernet import HEADS
from gmc.masks.sources import INITS
from gmc.masks.student import COMPILE_CHOICES, PRECISIONS

# Named sets of learning defaults (``--recipe``); gmc's own defaults are LearnConfig's.
RECIPES = {
    "paper": {"steps": 40000, "lr": 1e-3, "lam": 16.0, "budget": "penalty", "init": "none"},
}


@dataclass
class LearnConfig:
    steps: int = 40000
    batch_size: int = 1
    lr: float = 3e-3  # measured with lambda 64 (docs/learning.md); the paper's 1e-3: --recipe paper
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.999
    lam: float = 64.0  # budget weight (schedule, penalty); the paper's 16 reaches no budget in a CPU-sized run
    budget: str = "schedule"  # gmc.masks.budget: schedule | topk | penalty (the paper's)
    ramp: float = 0.2  # schedule/topk: fraction of the steps over which the target sparsity ramps up
    init: str = "none"  # gmc.masks.prior: none | magnitude | wanda | sparsegpt
    temperature: float = 0.4
    offset: float = 3.0
    noise: bool = False  # measured: noise-free straight-through reaches the budget faster (docs/learning.md)
    head: str = "full"
    rank: int = 16
    checkpoint_every: int = 1000
    checkpoint_dir: Optional[str] = None  # None: "<output>.ckpt"
    resume: bool = False
    kd_chunk_tokens: int = 512
    teacher_cache: bool = True  # gmc.masks.teacher: the dense trunk's output kept per calibration block
    precision: str = "auto"  # gmc.masks.harness.resolve_precision: bf16 GEMMs where the device runs them natively
    compile_step: str = "auto"  # gmc.masks.harness.Student: on | off | auto (on for runs of COMPILE_MIN_STEPS)
    learn_weights: bool = False  # train a delta of every target's weight with the masks
    weight_lr: float = 1e-4  # of the weight deltas (AdamW, no weight decay)
    optim_8bit: bool = False
    progress: bool = True
    grad_checkpointing: bool = False  # torchrun only: recompute decoder layers in backward
    fsdp_offload: bool = False  # torchrun on CUDA only: frozen weight shards live in host memory

    def __post_init__(self):
        for name in ("steps", "batch_size", "checkpoint_every", "rank", "kd_chunk_tokens"):
            check_at_least(f"--{name.replace('_', '-')}", getattr(self, name), 1)
        check_positive(self, "lr", "temperature", "lam", "weight_lr")
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
        if self.precision not in PRECISIONS:
            raise GmcError(f"bad --precision {self.precision!r}: expected one of {', '.join(PRECISIONS)}")
        if self.head not in HEADS:
            raise GmcError(f"bad --head {self.head!r}: expected one of {', '.join(HEADS)}")
        # an option of another setting would be ignored: refused ("passed": other than its default)
        if self.head != "lowrank":
            refuse_passed(self, ("rank",), "sets the lowrank head's rank: it applies with --head lowrank")
        if not self.learn_weights:
            refuse_passed(self, ("weight_lr",), "applies with --learn-weights")
        if self.budget == "penalty":
            refuse_passed(self, ("ramp",), "does not apply to --budget penalty: it holds the full target from step 1")
        if self.budget == "topk":
            refuse_passed(self, ("lam", "offset"), "does not apply to --budget topk: it ranks the logits (no "
                                                   "penalty term, no threshold)")
