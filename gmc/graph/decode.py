"""Exported decode: a causal LM as two ``torch.export`` programs over a static KV cache.

``CachedLM`` makes a HF causal LM a pure function of its inputs::

    logits [1, V] = step(input_ids [1, T], position [] int64, keys [L x [1, H, M, D]], values [...])

It writes the T new keys/values into the caches at ``position .. position + T - 1`` (in place: the
programs mutate their cache inputs) and returns the logits of the last token. ``M`` (``max_len``)
is fixed when the cache is made; attention reads only the filled slots (``position + T``).
Two programs come from it (``export_decode``): ``prefill`` (T dynamic, 2..M) and ``decode`` (T =
1, so the compiler specialises every shape). They are what the lowering pass
(``gmc.graph.pipeline.lower_decode``), Inductor and AOTInductor (``gmc.formats.compiled``) and gmc's own
generation loop (``gmc.runtime.generate``) work on. The position is an input rather than state, so one
cache serves both programs and a loop, not the program, owns where the sequence stands.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import StaticCache, StaticLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from gmc.errors import GmcError
from gmc.graph.trace import export, length_dim
from gmc.huge_pages import zeros_on_huge_pages
from gmc.kernels.decode_attention import decode_attention

PROGRAMS = ("prefill", "decode")
ATTENTION = "gmc_grouped"  # the attention CachedLM runs (registered with transformers below)


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA over a grouped-query cache without copying it per query head.

    HF's SDPA path under ``torch.export`` repeats each KV head for its query heads (``repeat_kv``):
    a copy of the whole static cache, per layer and per step. Here a one-token query on CPU is one
    ``gmc::decode_attention`` call (C++ kernel, fp32 inside, ``gmc/kernels/decode_attention.py``);
    elsewhere it becomes ``[B, H_kv, G, D]`` (the G query heads of a KV head are its query rows);
    longer queries use SDPA's own ``enable_gqa``. query ``[B, H, T, D]``, key/value ``[B, H_kv, M, D]``,
    mask ``[B, 1, T, M]`` (bool) or None; returns ``[B, T, H, D]`` as HF's interface expects.
    """
    batch, heads, tokens, dim = query.shape
    groups = heads // key.shape[1]
    if attention_mask is not None:  # the mask spans all M slots, the cache gives the filled ones
        attention_mask = attention_mask.narrow(-1, 0, key.shape[-2])
    scale = scaling if scaling is not None else dim ** -0.5
    if tokens == 1 and query.device.type == "cpu" and (attention_mask is None or attention_mask.dtype == torch.bool):
        out = decode_attention(query, key, value, attention_mask, scale)
    elif tokens == 1:  # not SDPA: its CUDA backend choice guards on the data-dependent key length
        rows = query.reshape(batch, key.shape[1], groups, dim)  # a view: T = 1
        scores = (rows @ key.transpose(-1, -2)) * scale  # [B, H_kv, G, M]
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
                else scores + attention_mask
        out = (scores.softmax(-1) @ value).reshape(batch, heads, 1, dim)
    else:
        causal = tokens > 1 and attention_mask is None and (is_causal if is_causal is not None else True)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, is_causal=causal,
                                             scale=scaling, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, grouped_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@contextlib.contextmanager
def _attention(model: torch.nn.Module, implementation: str):
    """Run ``model`` with another registered attention implementation, then restore its own."""
    configs = list({id(c): c for c in _configs(model.config)}.values())  # a text config may be the model's own
    saved = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = implementation
        yield
    finally:
        for config, name in zip(configs, saved):
            config._attn_implementation = name


def _configs(config):
    yield config
    if hasattr(config, "get_text_config"):
        yield config.get_text_config()


class _PositionedLayer(StaticLayer):
    """A static cache layer over caller-owned tensors that writes at ``position`` and never
    advances it (HF's ``StaticLayer`` keeps and bumps its own counter: state a program cannot own)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, static: bool = False):
        super().__init__(keys.shape[2])
        self.keys, self.values, self.cumulative_length = keys, values, position
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.static = static

    def update(self, key_states, value_states, *args, **kwargs):  # [1, H, T, D] each
        """Write the T new positions; return the filled slots ``[1, H, position + T, D]`` only, so
        attention reads what the sequence holds, not all M slots (decode time would grow with
        ``max_len`` rather than with the sequence). ``static``: all M slots, which the step's mask
        limits to the filled ones: no shape depends on the position, so a CUDA graph can hold the step."""
        tokens = key_states.shape[-2]
        index = torch.arange(tokens, device=key_states.device) + self.cumulative_length
        self.keys.index_copy_(2, index, key_states)
        self.values.index_copy_(2, index, value_states)
        if self.static:
            return self.keys, self.values
        position = self.cumulative_length.item()  # an unbacked size under export
        torch._check(position >= 0)
        torch._check(position + tokens <= self.keys.shape[2])
        length = position + tokens
        return self.keys.narrow(2, 0, length), self.values.narrow(2, 0, length)


# HF RoPE types whose cos and sin at a position do not depend on the sequence's length ("dynamic"
# and "longrope" rescale by it): a program of these reads them from a table (``CachedLM``).
TABULATED_ROPE = ("default", "linear", "llama3", "yarn")


def _rotary(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's one rotary embedding, when it is HF's kind (``forward(x, position_ids) -> (cos,
    sin)`` over ``inv_freq``) of a type in ``TABULATED_ROPE``; else None."""
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(found) != 1 or not hasattr(found[0], "inv_freq"):
        return None
    return found[0] if getattr(found[0], "rope_type", None) in TABULATED_ROPE else None


class CachedLM(torch.nn.Module):
    """``(input_ids, position, keys, values) -> last-token logits``; the HF model is ``self.model``,
    so parameter names in its graph are ``model.<HF name>`` as in ``gmc.graph.trace``.

    ``static``: attention reads all ``M`` cache slots under a mask made from the position (the
    positions are given, never read back to the host), so every shape and every address of a step
    is the same at every position: what a CUDA graph replays (``gmc.runtime.cuda_graph``). Without
    it, attention reads the filled slots only (the exported programs' way).

    ``max_len`` (the programs' ``M``): the rotary embedding's cos and sin for positions ``0 .. M - 1``
    are computed once, by the model's own module, into the buffers ``rope_cos`` and ``rope_sin``
    ``[M, head_dim]`` (fp32), and a step reads its positions' rows. Traced as the model computes
    them, they are a pointwise function of the position that Inductor fuses into each layer's
    consumer: 2 x layers x heads x head_dim sines and cosines a step. Models whose rotary embedding
    is of another kind (``_rotary``) compute them as they do."""

    def __init__(self, model: torch.nn.Module, static: bool = False, max_len: int | None = None):
        super().__init__()
        self.model = model
        self.static = static
        # the cache's keyword: ``cache`` where transformers has renamed ``past_key_values`` (which warns)
        self._cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        rotary = _rotary(model) if max_len is not None else None
        self._rotary = (rotary,) if rotary is not None else ()  # a tuple: not a second submodule
        if rotary is not None:
            positions = torch.arange(max_len, device=rotary.inv_freq.device)[None]
            with torch.no_grad():
                cos, sin = rotary(torch.zeros(1, device=positions.device), positions)
            self.register_buffer("rope_cos", cos[0].float(), persistent=False)
            self.register_buffer("rope_sin", sin[0].float(), persistent=False)

    def _table(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's ``(cos, sin)`` at ``position_ids`` ``[B, T]``, from the tables."""
        return self.rope_cos[position_ids].to(x.dtype), self.rope_sin[position_ids].to(x.dtype)

    @contextlib.contextmanager
    def _tabulated(self):
        """The model's rotary embedding reading the tables while a step runs."""
        for rotary in self._rotary:
            rotary.forward = self._table
        try:
            yield
        finally:
            for rotary in self._rotary:
                del rotary.forward

    def forward(self, input_ids, position, keys: list, values: list) -> torch.Tensor:
        cache = StaticCache(config=self.model.config, max_cache_len=keys[0].shape[2])
        cache.layers = [_PositionedLayer(k, v, position, self.static) for k, v in zip(keys, values)]
        extra = {}
        if self.static:
            positions = position + torch.arange(input_ids.shape[1], device=input_ids.device)  # [T]
            slots = torch.arange(keys[0].shape[2], device=input_ids.device)  # [M]
            mask = (slots[None, :] <= positions[:, None])[None, None]  # [1, 1, T, M]: causal over the filled slots
            extra = dict(attention_mask=mask, position_ids=positions[None], cache_position=positions)
        with _attention(self.model, ATTENTION), self._tabulated():
            extra[self._cache_keyword] = cache
            out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **extra)
        return out.logits[:, -1]  # [1, V]


@dataclass
class KVCache:
    """The static cache a pair of programs reads and writes: one key and one value tensor per layer."""

    keys: list = field(default_factory=list)  # L x [1, H_kv, M, D]
    values: list = field(default_factory=list)

    @classmethod
    def empty(cls, config, max_len: int, dtype=torch.float32, device="cpu") -> "KVCache":
        """Zeros; on the CPU in one mapping on 2 MiB pages (decode 1.01-1.03x: docs/speed.md,
        "Weights on huge pages")."""
        layers, heads, dim = cache_shape(config)
        shape = (1, heads, max_len, dim)
        if torch.device(device).type == "cpu":
            tensors = zeros_on_huge_pages([shape] * (2 * layers), dtype)
            return cls(tensors[:layers], tensors[layers:])
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)])

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def cache_shape(config) -> tuple[int, int, int]:
    """``(layers, kv heads, head dim)`` of a HF decoder config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, dim


def example_inputs(config, max_len: int, program: str, dtype=torch.float32, device="cpu") -> tuple:
    """Inputs to trace ``program`` with (a 2-token prompt for prefill, its smallest dynamic size
    that does not specialise). The cache tensors have a storage each, not ``KVCache.empty``'s one
    mapping: export treats views of one storage as aliases, and an op that writes a layer's cache
    (``gmc::attention_block``) then made the compiled program copy every layer's cache at every call."""
    ids = torch.zeros((1, 2 if program == "prefill" else 1), dtype=torch.long, device=device)
    layers, heads, dim = cache_shape(config)
    shape = (1, heads, max_len, dim)
    keys, values = ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)] for _ in range(2))
    return ids, torch.tensor(0, device=device), keys, values


def export_step(module: torch.nn.Module, config, max_len: int, program: str,
                dtype=torch.float32, device="cpu") -> torch.export.ExportedProgram:
    """``torch.export`` of a ``CachedLM`` (or of its graph after passes) as ``prefill`` or ``decode``."""
    if program not in PROGRAMS:
        raise GmcError(f"bad program {program!r}: expected one of {', '.join(PROGRAMS)}")
    if max_len < 2:
        raise GmcError(f"bad max_len {max_len}: the cache needs at least 2 positions")
    inputs = example_inputs(config, max_len, program, dtype, device)
    layers = len(inputs[2])
    tokens = {1: length_dim("tokens", max_len, device)} if program == "prefill" else None
    dynamic = (tokens, None, [None] * layers, [None] * layers)
    return export(module, inputs, dynamic)


def export_decode(model: torch.nn.Module, max_len: int) -> dict[str, torch.export.ExportedProgram]:
    """The prefill and decode programs of a HF causal LM (dense, folded or eager-lowered)."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    module = CachedLM(model, max_len=max_len)
    try:
        return {name: export_step(module, model.config, max_len, name, dtype, device) for name in PROGRAMS}
    except GmcError:
        raise
    except Exception as error:  # export raises many types; the user needs the class and first line
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise GmcError(f"cannot export {type(model).__name__} with a static KV cache: {first}") from error
