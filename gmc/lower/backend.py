"""What a lowering backend is: a name, the output it writes, what it refuses, how it writes.

A backend is one module of ``gmc.lower.backends`` defining one ``Backend`` subclass; the stage
(``gmc.lower.stage``) loads the artifact and the model, then calls ``check`` before any model
loads and ``write`` after.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from tqdm.auto import tqdm

from gmc.errors import GmcError

# the artifact's manifest keys a lowered output keeps: what it was made from and how
PROVENANCE = ("model", "group", "method", "allocation", "target_sparsity", "global_sparsity", "calibration", "seed",
              "gmc_version", "provenance")


@dataclass(frozen=True)
class LowerResult:
    path: Path
    packed_bytes: int  # target weights as stored: kept values + indices (dense: the dense bytes)
    dense_bytes: int  # the same targets stored dense


class Backend:
    """One way to lower a masks artifact; subclasses set the class attributes and ``write``."""

    name: ClassVar[str]
    help: ClassVar[str]  # one line for ``gmc lower --help``
    kind: ClassVar[str]  # the output kind (gmc.formats.outputs): what --overwrite may replace
    devices: ClassVar[tuple[str, ...]] = ("cpu",)  # device types whose kernels the output runs on
    options: ClassVar[tuple[str, ...]] = ()  # the LowerConfig fields only this backend reads
    group_patterns_only: ClassVar[bool] = True  # N:M masks cannot be packed into groups

    def check(self, config) -> None:
        """Refuse, before any model loads, what this backend cannot do with ``config``."""
        if device_type(config.device) not in self.devices:
            raise GmcError(f"--backend {self.name} writes for {' or '.join(self.devices)}, not --device "
                           f"{config.device}")

    def check_pattern(self, pattern) -> None:
        if self.group_patterns_only and not pattern.packable:
            raise GmcError(f"--backend {self.name} cannot lower the N:M pattern {pattern}: it packs group patterns "
                           "(GOUTxGIN such as 1x256, 1x64, 32x32); fold N:M masks into a dense checkpoint with "
                           "--backend dense")

    def steps(self, config) -> int:
        """How many times ``write`` calls its ``steps`` (the progress bar's length)."""
        return 1

    def write(self, config, artifact, loaded, steps: "Steps") -> LowerResult:
        """Write ``artifact``'s masks over ``loaded`` (its base model) at ``config.output``, calling
        ``steps(label)`` as each of its ``self.steps(config)`` steps starts."""
        raise NotImplementedError


class Steps:
    """A progress bar of a stage's named steps on stderr: ``steps("packing")`` closes the running
    step and starts the next. Lowering a 7B model takes minutes, mostly in one step at a time."""

    def __init__(self, total: int, title: str, enabled: bool = True):
        self._bar = tqdm(total=total, desc=title, unit="step", disable=not enabled, leave=False,
                         bar_format="{desc}: {n_fmt}/{total_fmt} {postfix} [{elapsed}]")
        self._started = False

    def __call__(self, label: str) -> None:
        if self._started:
            self._bar.update()
        self._started = True
        self._bar.set_postfix_str(label)

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc) -> None:
        if self._started and exc[0] is None:
            self._bar.update()
        self._bar.close()


def device_type(device: str) -> str:
    """``cuda`` of ``cuda:1``: what a backend's kernels are for."""
    return device.split(":")[0]


def target_bytes(model: torch.nn.Module, names) -> int:
    """Bytes of the dense weights of the targets ``names`` of ``model``."""
    return sum(model.get_submodule(name).weight.nbytes for name in names)
