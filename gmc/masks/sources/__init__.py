"""The mask sources: one module per ``--method`` and the one table of them, ``SOURCES``.

Everything that depends on the method reads this table: ``gmc.masks.prune`` (which source chooses the
masks, which allocations and options apply, whether calibration blocks are read),
``gmc.masks.prune_distributed`` (only learning sources run under torchrun), ``gmc.masks.learn``
(``--init`` offers every source with a prior: ``INITS``) and the CLI (``METHODS``, ``METHOD_HELP``,
``ALLOCATION_CHOICES``, ``ALLOCATION_HELP``). A new method is a module defining a ``MaskSource``, its
test and one line below (docs/design.md, "Adding a mask method").
"""
from __future__ import annotations

from gmc.masks.sources import learned, magnitude, sparsegpt, wanda
from gmc.masks.sources.base import ChosenMasks, MaskSource

SOURCES: dict[str, MaskSource] = {source.name: source for source in (
    learned.GROUPMASK,
    learned.DIRECT,
    magnitude.SOURCE,
    wanda.SOURCE,
    sparsegpt.SOURCE,
)}

METHODS = tuple(SOURCES)
LEARNED_METHODS = tuple(name for name, source in SOURCES.items() if source.learns)
INITS = ("none", *(name for name, source in SOURCES.items() if source.prior is not None))
METHOD_HELP = "; ".join(f"{name}: {source.help}" for name, source in SOURCES.items()) + "."
ALLOCATION_CHOICES = tuple(sorted({allocation for source in SOURCES.values() for allocation in source.allocations}))
ALLOCATION_HELP = ("How the budget is shared between layers [default: the method's first]. " + "; ".join(
    f"{name}: {' | '.join(source.allocations)}" for name, source in SOURCES.items()) + ".")

__all__ = ["SOURCES", "METHODS", "LEARNED_METHODS", "INITS", "METHOD_HELP", "ALLOCATION_CHOICES", "ALLOCATION_HELP",
           "ChosenMasks", "MaskSource"]
