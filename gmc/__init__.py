"""gmc: learned, layer-adaptive group sparsity for Hugging Face causal LMs (GroupMask).

``import gmc`` registers the ``gmc::`` ops (so ``torch.export.load`` of a lowered ``program.pt2``
and the compiled packages find them) and the packed checkpoint format (so
``AutoModelForCausalLM.from_pretrained`` of a ``gmc lower`` directory builds packed modules).
The in-memory API (``gmc.api``: ``prune_``, ``lower_``, ``PruneConfig``, ``LowerOptions``,
``calibration_blocks``) is imported on first use: it pulls in the whole pipeline, which a process
that only loads a program does not need.
"""
import gmc.formats.hf_checkpoint  # noqa: F401  (registers the packed checkpoint format with transformers)
import gmc.kernels  # noqa: F401  (registers the gmc:: ops)
from gmc.config import __version__

_API = ("prune_", "lower_", "PruneConfig", "LowerOptions", "calibration_blocks")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        import gmc.api

        return getattr(gmc.api, name)
    raise AttributeError(f"module 'gmc' has no attribute {name!r}")
