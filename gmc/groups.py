"""Sparsity patterns: group shapes (``1x256``, ``32x32``) and N:M (``2:4``).

A pattern maps a weight of shape ``(d_out, d_in)`` to a *selector* tensor, one entry per
decision. For a group pattern ``g_out x g_in`` the selector ``B`` has shape
``(ceil(d_out/g_out), ceil(d_in/g_in))`` and the full mask is ``kron(B, ones(g_out, g_in))``
cropped to the weight (docs/design.md section 1); the last group along a dimension that is not a
multiple of the group size is smaller (ragged) and every count below weighs groups by the real
parameters they hold. An N:M pattern selects single weights, so its selector has the weight's
own shape, and at most N of every M consecutive input weights are kept.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Union

import torch

from gmc.errors import GmcError

_GROUP_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_NM_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")
MAX_GROUP = 1 << 16  # above any weight dimension of today's LMs; larger sizes only overflow


@dataclass(frozen=True)
class GroupSpec:
    """Groups of ``g_out`` output rows by ``g_in`` consecutive input columns."""

    g_out: int
    g_in: int

    def __post_init__(self):
        for name in ("g_out", "g_in"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GmcError(f"group {name} must be a positive integer, got {value!r}")

    def __str__(self) -> str:
        return f"{self.g_out}x{self.g_in}"

    packable = True  # kept groups pack into the group-sparse layout (gmc.kernels.packed)
    learnable = True  # any group may go: a learned budget trades groups across layers
    fixed_sparsity = None  # how much each target keeps is the mask source's choice (its allocation)

    @property
    def block_width(self) -> int:
        """Input columns that must stay together: a column block of SparseGPT is a multiple of it."""
        return self.g_in

    def span(self, grid: tuple[int, int]) -> tuple[int, int]:
        """The weight shape a selector ``grid`` covers (ragged edge groups counted whole)."""
        return grid[0] * self.g_out, grid[1] * self.g_in

    def grid(self, shape: tuple[int, int]) -> tuple[int, int]:
        """Selector shape ``(G_out, G_in)`` for a weight of ``shape`` (ceil division)."""
        d_out, d_in = shape
        return math.ceil(d_out / self.g_out), math.ceil(d_in / self.g_in)

    def expand(self, selectors: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """Full-resolution mask ``[d_out, d_in]`` from selectors ``[G_out, G_in]``."""
        d_out, d_in = shape
        mask = selectors.repeat_interleave(self.g_out, 0).repeat_interleave(self.g_in, 1)
        return mask[:d_out, :d_in]

    def group_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum ``values [d_out, d_in]`` over each group -> ``[G_out, G_in]`` (ragged aware)."""
        d_out, d_in = values.shape
        G_out, G_in = self.grid((d_out, d_in))
        pad = (0, G_in * self.g_in - d_in, 0, G_out * self.g_out - d_out)
        padded = torch.nn.functional.pad(values, pad) if any(pad) else values
        return padded.reshape(G_out, self.g_out, G_in, self.g_in).sum(dim=(1, 3))

    def group_sizes(self, shape: tuple[int, int]) -> torch.Tensor:
        """Number of real parameters in each group, ``[G_out, G_in]`` (int64)."""
        d_out, d_in = shape
        G_out, G_in = self.grid(shape)
        rows = torch.full((G_out,), self.g_out, dtype=torch.int64)
        cols = torch.full((G_in,), self.g_in, dtype=torch.int64)
        rows[-1] = d_out - (G_out - 1) * self.g_out
        cols[-1] = d_in - (G_in - 1) * self.g_in
        return rows[:, None] * cols[None, :]


@dataclass(frozen=True)
class NMSpec:
    """Semi-structured N:M sparsity: at most ``n`` kept in every ``m`` consecutive inputs."""

    n: int
    m: int

    def __post_init__(self):
        if not (isinstance(self.n, int) and isinstance(self.m, int) and 0 < self.n < self.m):
            raise GmcError(f"N:M pattern needs 0 < N < M, got {self.n}:{self.m}")

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"

    packable = False  # N:M keeps single weights: lowered by folding into a dense checkpoint
    learnable = False  # every run of m inputs keeps n: no budget is left to learn

    @property
    def sparsity(self) -> float:
        return 1.0 - self.n / self.m

    @property
    def fixed_sparsity(self) -> float:
        """The pattern fixes every row's sparsity: no allocation or budget chooses it."""
        return self.sparsity

    @property
    def block_width(self) -> int:
        return self.m

    def span(self, grid: tuple[int, int]) -> tuple[int, int]:
        return tuple(grid)

    def grid(self, shape: tuple[int, int]) -> tuple[int, int]:
        return tuple(shape)

    def expand(self, selectors: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        return selectors

    def group_sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def group_sizes(self, shape: tuple[int, int]) -> torch.Tensor:
        return torch.ones(shape, dtype=torch.int64)


Pattern = Union[GroupSpec, NMSpec]


def parse_pattern(text: str) -> Pattern:
    """Parse ``"1x256"`` / ``"32x32"`` into a GroupSpec, ``"2:4"`` into an NMSpec."""
    if isinstance(text, (GroupSpec, NMSpec)):
        return text
    match = _GROUP_RE.match(str(text))
    if match:
        g_out, g_in = int(match[1]), int(match[2])
        if g_out < 1 or g_in < 1:
            raise GmcError(f"bad group {text!r}: both sizes must be positive (e.g. 1x256, 32x32)")
        if max(g_out, g_in) > MAX_GROUP:
            raise GmcError(f"bad group {text!r}: group sizes are at most {MAX_GROUP} (e.g. 1x256, 32x32)")
        return GroupSpec(g_out, g_in)
    match = _NM_RE.match(str(text))
    if match:
        if int(match[2]) > MAX_GROUP:
            raise GmcError(f"bad group {text!r}: M of N:M is at most {MAX_GROUP} (e.g. 2:4)")
        return NMSpec(int(match[1]), int(match[2]))
    raise GmcError(
        f"bad group {text!r}: expected GOUTxGIN with positive sizes (1x256, 1x64, 32x32) or N:M (2:4)"
    )


def kept_params(pattern: Pattern, selectors: torch.Tensor, shape: tuple[int, int]) -> int:
    """Real parameters kept by binary ``selectors`` on a weight of ``shape``."""
    if isinstance(pattern, NMSpec):
        return int(selectors.bool().sum())
    return int((selectors.bool().long() * pattern.group_sizes(shape)).sum())


def layer_sparsity(pattern: Pattern, selectors: torch.Tensor, shape: tuple[int, int]) -> float:
    """``s^l = 1 - kept / params`` for one target."""
    return 1.0 - kept_params(pattern, selectors, shape) / (shape[0] * shape[1])


def global_sparsity(
    pattern: Pattern, selectors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, int]]
) -> float:
    """Parameter-weighted mean sparsity over all targets (paper Eq. 2)."""
    kept = sum(kept_params(pattern, selectors[name], shapes[name]) for name in selectors)
    total = sum(shapes[name][0] * shapes[name][1] for name in selectors)
    return 1.0 - kept / total

