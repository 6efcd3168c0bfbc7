"""Masks read from the zeros of a checkpoint pruned elsewhere (``gmc lower HF_DIR --group 1x64``).

Why: Wanda, SparseGPT or llm-compressor write a dense checkpoint whose pruned weights are zeros.
Where those zeros fill whole groups of a pattern, the all-zero groups are masks like gmc's own, and
the packed backends then read only the groups that hold a nonzero weight. Lowering this way is exact
whatever the zeros: a group with one nonzero weight is kept whole, zeros and all, and the derived
artifact carries the checkpoint's own target weights, so the lowered model computes what the
checkpoint computes.

The refusal guards the speed, not the numbers: when most zeros lie outside all-zero groups, the
``--group`` is not the pattern the checkpoint was pruned to (unstructured or N:M zeros, or another
group shape), and the lowered model would still multiply by them. ``zero_tolerance`` is the share
of zero weights allowed outside all-zero groups (weights that happen to be zero in a kept group).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from gmc.config import refuse_passed
from gmc.errors import GmcError
from gmc.formats.artifact import MANIFEST_FILE, MaskArtifact, build_manifest, model_fingerprint
from gmc.formats.hf_checkpoint import packed_config
from gmc.graph.targets import eager_targets
from gmc.groups import GroupSpec, parse_pattern
from gmc.inputs.model import LoadedModel

METHOD = "zeros"  # the manifest's method: the masks are the checkpoint's all-zero groups


@dataclass(frozen=True)
class ZeroGroups:
    """How the zero weights of one or more targets lie in the groups of a pattern."""

    params: int = 0  # weights
    zeros: int = 0  # weights equal to zero
    groups: int = 0  # groups of the pattern's grid
    zero_groups: int = 0  # groups whose weights are all zero
    in_zero_groups: int = 0  # zero weights lying in all-zero groups: the weights of those groups

    def __add__(self, other: "ZeroGroups") -> "ZeroGroups":
        return ZeroGroups(*(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__))

    @property
    def zero_fraction(self) -> float:
        return self.zeros / max(self.params, 1)

    @property
    def zero_group_fraction(self) -> float:
        """Share of groups (counted, not weighed) that are all zero."""
        return self.zero_groups / max(self.groups, 1)

    @property
    def grouped_fraction(self) -> Optional[float]:
        """Share of the zero weights that lie in all-zero groups; None without zeros."""
        return self.in_zero_groups / self.zeros if self.zeros else None


def zero_groups(weight: torch.Tensor, spec: GroupSpec) -> tuple[torch.Tensor, ZeroGroups]:
    """``(empty [G_out, G_in] bool, counts)``: which groups of ``weight [d_out, d_in]`` are all zero."""
    shape = tuple(weight.shape)
    nonzero = spec.group_sum((weight != 0).to(torch.int32))  # [G_out, G_in] nonzero weights per group
    empty = nonzero == 0
    sizes = spec.group_sizes(shape)  # [G_out, G_in] real weights per group (ragged edges)
    params = shape[0] * shape[1]
    counts = ZeroGroups(params=params, zeros=params - int(nonzero.sum()), groups=empty.numel(),
                        zero_groups=int(empty.sum()), in_zero_groups=int(sizes[empty].sum()))
    return empty, counts


def check_source(config) -> None:
    """What ``LowerConfig`` refuses about its ARTIFACT and ``--group`` before anything loads: a checkpoint
    without ``--group`` (it has no masks file), ``--group`` with a masks artifact or a lowered model,
    an N:M ``--group``, ``--model`` beside a checkpoint, a tolerance outside [0, 1)."""
    artifact, group, tolerance = config.artifact, config.group, config.zero_tolerance
    path = Path(artifact).expanduser()
    is_dir = path.is_dir()
    if group is None:
        refuse_passed(config, ["zero_tolerance"], "applies with --group (a HF checkpoint's zeros), not to a masks "
                                                  "artifact")
        if is_dir and (path / "config.json").is_file() and not (path / MANIFEST_FILE).is_file() \
                and packed_config(path) is None:
            raise GmcError(f"{artifact} is a HF checkpoint, not a masks artifact: pass --group GOUTxGIN (e.g. --group "
                           f"1x64) to lower the groups its zero weights form")
        return
    pattern = parse_pattern(group)
    if not isinstance(pattern, GroupSpec):
        raise GmcError(f"--group {pattern} is N:M: the zeros a checkpoint is lowered by are GOUTxGIN groups "
                       f"(1x64, 32x32)")
    if is_dir and (path / MANIFEST_FILE).is_file():
        raise GmcError(f"--group applies to a HF checkpoint pruned elsewhere; {artifact} is a masks artifact, whose "
                       f"masks have their own pattern: drop --group")
    if is_dir and packed_config(path) is not None:
        raise GmcError(f"{artifact} is a lowered gmc model, packed already: --group lowers a dense HF checkpoint")
    if config.model is not None:
        raise GmcError(f"--model names the base model of a masks artifact; with --group, {artifact} is the model")
    if not 0.0 <= tolerance < 1.0:
        raise GmcError(f"bad --zero-tolerance {tolerance}: must be in [0, 1)")


def artifact_from_zeros(loaded: LoadedModel, pattern: GroupSpec, tolerance: float) -> MaskArtifact:
    """The masks artifact of ``loaded``'s all-zero groups: masks keep every group holding a nonzero
    weight, ``weights`` are the model's own target weights, and the fingerprint is the model's, so
    ``check_matches`` passes. Refused when the targets have no all-zero group, or when more than
    ``tolerance`` of their zero weights lie outside all-zero groups."""
    masks, weights, shapes, total = {}, {}, {}, ZeroGroups()
    for target in eager_targets(loaded.model):
        weight = loaded.model.get_submodule(target.name).weight.detach()  # [d_out, d_in]
        empty, counts = zero_groups(weight, pattern)
        masks[target.name], weights[target.name], shapes[target.name] = ~empty, weight, target.shape
        total += counts
    check_zeros(loaded.ref, pattern, total, tolerance)
    manifest = build_manifest(
        model_ref=loaded.ref, fingerprint=model_fingerprint(loaded.model), pattern=pattern, masks=masks,
        shapes=shapes, method=METHOD, allocation=METHOD, target_sparsity=total.in_zero_groups / total.params,
        calibration="none", seed=0, provenance=f"derived from zeros of {loaded.ref}",
    )
    return MaskArtifact(masks, manifest, weights)


def check_zeros(where: str, pattern: GroupSpec, total: ZeroGroups, tolerance: float) -> None:
    """Refuse targets whose zeros do not form ``pattern`` (see the module docstring)."""
    if total.zero_groups == 0:
        raise GmcError(f"no all-zero {pattern} groups in {where}'s targets: nothing to lower; "
                       f"{total.zero_group_fraction:.1%} of groups are zero ({total.zero_fraction:.1%} of weights)")
    grouped = total.grouped_fraction
    if grouped < 1.0 - tolerance:
        raise GmcError(f"the zeros of {where}'s targets do not form {pattern} groups: {grouped:.1%} of its "
                       f"{total.zeros:,} zero weights lie in all-zero groups, below {1.0 - tolerance:.1%} "
                       f"(--zero-tolerance {tolerance}); `gmc info {where} --group GOUTxGIN` measures another group")
