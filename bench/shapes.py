"""Linear-layer shapes the operator benchmarks share (imported as ``shapes``: bench scripts run as
``python bench/<script>.py``, which puts this folder on ``sys.path``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    d_out: int
    d_in: int


LLAMA2_7B = (
    Shape("q/k/v/o 4096x4096", 4096, 4096),
    Shape("gate/up 11008x4096", 11008, 4096),
    Shape("down 4096x11008", 4096, 11008),
)
