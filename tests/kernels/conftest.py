"""Kernel tests run the Triton kernels on CPU through the interpreter.

``TRITON_INTERPRET`` must be set before triton is imported, so it is set here, at collection.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from gmc.groups import GroupSpec
from gmc.packed import pack

# (group, weight shape): every group shape of issue 4 plus ragged shapes in both dimensions.
CASES = [
    ("1x64", (128, 320)),
    ("1x128", (96, 384)),
    ("1x256", (64, 512)),
    ("16x16", (80, 96)),
    ("32x32", (96, 128)),
    ("64x64", (192, 256)),
    ("1x256", (96, 576)),
    ("32x32", (100, 70)),
]


def random_selectors(spec: GroupSpec, shape, sparsity: float, seed: int) -> torch.Tensor:
    """Selectors keeping about ``1 - sparsity`` of the groups, with an empty output group
    (rows with no kept group) and an empty input block."""
    gen = torch.Generator().manual_seed(seed)
    G_out, G_in = spec.grid(shape)
    keep = (torch.rand(G_out, G_in, generator=gen) >= sparsity).float()
    keep[0] = 0
    if G_in > 1:
        keep[:, 1] = 0
    return keep


@pytest.fixture
def packed_case():
    """``make(group, shape, sparsity, dtype, seed) -> (packed, dense masked weight fp32)``."""

    def make(group: str, shape, sparsity: float, dtype=torch.float32, seed: int = 0):
        spec = GroupSpec(*map(int, group.split("x")))
        gen = torch.Generator().manual_seed(seed + 1)
        weight = torch.randn(shape, generator=gen)
        bias = torch.randn(shape[0], generator=gen)
        packed = pack(weight, random_selectors(spec, shape, sparsity, seed), spec, bias).to(dtype=dtype)
        return packed, packed.unpack().float()

    return make
