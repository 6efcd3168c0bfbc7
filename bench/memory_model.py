"""Per-device memory of GroupMask mask learning under FSDP2: pure arithmetic, no downloads.

    python bench/memory_model.py                 # markdown tables (docs/scaling.md)
    python bench/memory_model.py --seq-len 4096 --group-in 128

Terms (GB = 1e9 bytes, one sequence of ``seq`` tokens per device, bf16 weights and activations):

* weights: ``2 * P / N`` (frozen, sharded by ``fully_shard``), plus the FSDP2 all-gather
  buffers of two unsharded decoder layers (the running one and the prefetched next).
* activations, no checkpointing: per layer and token ``18 h + 6 h_kv + 8 i`` bytes, counted from
  what autograd keeps in a LLaMA layer with a flash/efficient attention kernel: the fp32 copy the
  HF RMSNorm makes of its input (4 h, twice), the shared input of q/k/v and of gate/up (2 h each),
  rotated q and k (2 h + 2 h_kv), v (2 h_kv), the attention output (2 h), the gate output, silu(gate),
  up and their product (4 x 2 i) -- Korthikanti et al. 2022's count redone for SwiGLU and GQA. As
  ``c * seq * hidden * 2 bytes``: ``c = 9 + 3 h_kv / h + 4 i / h`` (22.75 for LLaMA-2-7B). gmc's
  masked linear adds nothing per token (it saves x, the frozen W and the small B).
* activations, checkpointing each decoder layer: the ``2 h`` layer inputs of all layers plus one
  layer's full activations during its recompute.
* logits: teacher and student ``[seq, V]`` in bf16 plus the KD gradient, ``3 * 2 * seq * V``.
* selectors: per group, logits, their detached copy, its gradient, soft and hard selectors and the
  all-reduce buffer, fp32: ``6 * 4 * G``.
* hypernetwork: ``full`` head 128 parameters per group (the paper's), ``lowrank`` head ``r`` per
  group + ``128 r`` per target; AdamW in fp32 costs 16 bytes per parameter (weight, grad, 2
  states), 8-bit AdamW 10. Replicated on every device (``gmc.masks.distributed`` says why).
* authors' setup: their masked linear keeps ``W * M`` (bf16) of every target for backward, a full
  model's worth of target weights per device whatever the sharding, and the full head with 8-bit
  AdamW.
* heads sharded (planned, not implemented): the lowrank head's per-target parameters split across
  the devices, the trunk replicated.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

GB = 1e9
GRU_PARAMS = 2 * 3 * (32 * 64 + 64 * 64 + 2 * 64) + 2 * 128  # bi-GRU 32 -> 64 + LayerNorm(128)


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 128
    tied: bool = False

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def targets(self) -> list[tuple[int, int]]:
        """(d_out, d_in) of q, k, v, o, gate, up, down of one layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_dim, self.intermediate
        return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]

    def layer_params(self) -> int:
        return sum(o * i for o, i in self.targets()) + 2 * self.hidden  # + 2 RMSNorm weights

    def target_params(self) -> int:
        return self.layers * sum(o * i for o, i in self.targets())

    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params() + embeddings + self.hidden

    def groups(self, g_out: int, g_in: int) -> int:
        return self.layers * sum(math.ceil(o / g_out) * math.ceil(i / g_in) for o, i in self.targets())


MODELS = (
    ModelShape("LLaMA-2-7B", 4096, 11008, 32, 32, 32, 32000),
    ModelShape("LLaMA-2-13B", 5120, 13824, 40, 40, 40, 32000),
    ModelShape("LLaMA-3-8B", 4096, 14336, 32, 32, 8, 128256),
    ModelShape("Qwen3-14B", 5120, 17408, 40, 40, 8, 151936),
    ModelShape("LLaMA-3-70B", 8192, 28672, 80, 64, 8, 128256),
)
DEVICES = (1, 2, 4, 8, 16)


def activation_bytes_per_token_layer(m: ModelShape) -> int:
    return 18 * m.hidden + 6 * m.kv_dim + 8 * m.intermediate


def activations(m: ModelShape, seq: int, checkpointing: bool) -> float:
    per_layer = seq * activation_bytes_per_token_layer(m)
    if checkpointing:
        return m.layers * seq * 2 * m.hidden + per_layer
    return m.layers * per_layer


def logits(m: ModelShape, seq: int) -> float:
    return 3 * 2 * seq * m.vocab


def hypernet_params(m: ModelShape, groups: int, head: str, rank: int) -> int:
    targets = 7 * m.layers
    if head == "full":
        return 128 * groups + GRU_PARAMS
    return rank * groups + 128 * rank * targets + GRU_PARAMS


@dataclass(frozen=True)
class Budget:
    weights: float
    fsdp_buffers: float
    act_full: float
    act_ckpt: float
    logits: float
    selectors: float
    head_full: float  # fp32 AdamW
    head_full_8bit: float
    head_lowrank: float
    authors: float
    gmc: float  # lowrank head, checkpointing
    gmc_full_head: float  # paper head, fp32 AdamW, checkpointing
    gmc_sharded_heads: float  # lowrank head sharded by target across devices (not implemented yet)


def budget(m: ModelShape, devices: int, seq: int, g_out: int, g_in: int, rank: int) -> Budget:
    groups = m.groups(g_out, g_in)
    weights = 2 * m.params() / devices
    buffers = 2 * 2 * m.layer_params() if devices > 1 else 0.0
    act_full, act_ckpt = activations(m, seq, False), activations(m, seq, True)
    lg, sel = logits(m, seq), 6 * 4 * groups
    full = 16 * hypernet_params(m, groups, "full", rank)
    full8 = 10 * hypernet_params(m, groups, "full", rank)
    low = 16 * hypernet_params(m, groups, "lowrank", rank)
    authors = weights + buffers + act_full + 2 * m.target_params() + lg + sel + full8
    gmc = weights + buffers + act_ckpt + lg + sel + low
    gmc_full = weights + buffers + act_ckpt + lg + sel + full
    sharded = weights + buffers + act_ckpt + lg + sel + low / devices
    return Budget(*(x / GB for x in (weights, buffers, act_full, act_ckpt, lg, sel, full, full8, low, authors,
                                     gmc, gmc_full, sharded)))


def table(seq: int, g_out: int, g_in: int, rank: int) -> str:
    out = []
    for m in MODELS:
        groups = m.groups(g_out, g_in)
        full, low = hypernet_params(m, groups, "full", rank), hypernet_params(m, groups, "lowrank", rank)
        out.append(f"### {m.name}: {m.params() / 1e9:.2f}B parameters, {m.target_params() / 1e9:.2f}B in targets, "
                   f"{groups / 1e6:.1f}M groups of {g_out}x{g_in}; hypernetwork {full / 1e9:.2f}B (full head) / "
                   f"{low / 1e6:.0f}M (lowrank r={rank}) parameters\n")
        out.append("| devices | weights (bf16, sharded) | FSDP buffers | act. no ckpt | act. ckpt | logits "
                   "| selectors | full head AdamW fp32 / 8-bit | lowrank head AdamW | **gmc** (lowrank, ckpt) "
                   "| gmc (full head, ckpt) "
                   "| **authors** (W*M kept, full head 8-bit) | gmc, lowrank heads sharded (planned) |")
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n in DEVICES:
            b = budget(m, n, seq, g_out, g_in, rank)
            out.append(f"| {n} | {b.weights:.1f} | {b.fsdp_buffers:.1f} | {b.act_full:.1f} | {b.act_ckpt:.1f} "
                       f"| {b.logits:.2f} | {b.selectors:.2f} | {b.head_full:.1f} / {b.head_full_8bit:.1f} "
                       f"| {b.head_lowrank:.1f} | **{b.gmc:.1f}** | {b.gmc_full_head:.1f} | **{b.authors:.1f}** "
                       f"| {b.gmc_sharded_heads:.1f} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--group-out", type=int, default=1)
    parser.add_argument("--group-in", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16, help="rank of the lowrank head")
    args = parser.parse_args()
    print(f"Per-device GB (1e9 bytes), seq {args.seq_len}, one sequence per device, groups "
          f"{args.group_out}x{args.group_in}.\n")
    print(table(args.seq_len, args.group_out, args.group_in, args.rank))


if __name__ == "__main__":
    main()
