"""Text sources and token blocks for calibration and evaluation.

A source is a hub dataset name (``wikitext2``, ``wikitext103``, ``alpaca``, ``c4``), a local
``.txt`` (one document or line per line) or ``.jsonl`` (a ``text`` field per record), or the
bundled public-domain text (``bundled`` / ``bundled-heldout``, see ``gmc/data/README.md``).
Hub datasets fail offline with one line that suggests a local file instead.

Calibration blocks follow docs/design.md section 5: each line tokenised with BOS prepended,
concatenated, cut into ``seq_len`` blocks, shuffled with the seed.
"""
from __future__ import annotations

import json
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from gmc.config import cache_root, check_seq_len, option
from gmc.errors import GmcError
from gmc.formats.artifact import model_fingerprint
from gmc.formats.atomic import atomic_write_bytes

DATA_DIR = Path(__file__).parents[1] / "data"
BUNDLED = {"bundled": DATA_DIR / "calib.txt", "bundled-heldout": DATA_DIR / "heldout.txt"}


@dataclass(frozen=True)
class HubText:
    path: str
    name: str | None
    column: str
    splits: tuple[str, ...]
    data_files: str | None = None


HUB = {
    "wikitext2": HubText("wikitext", "wikitext-2-raw-v1", "text", ("train", "validation", "test")),
    "wikitext103": HubText("wikitext", "wikitext-103-raw-v1", "text", ("train", "validation", "test")),
    "alpaca": HubText("tatsu-lab/alpaca", None, "text", ("train",)),
    "c4": HubText("allenai/c4", None, "text", ("train", "validation"),
                  data_files="en/c4-validation.00000-of-00008.json.gz"),
}
SOURCES_HELP = f"{', '.join(HUB)}, bundled, bundled-heldout, a local .txt/.jsonl path"


def calib_option(default: Optional[str] = "wikitext2", self_generated: bool = False):
    """The ``--calib`` field of a command that reads calibration text."""
    extra = ", or self (the model writes its own text)" if self_generated else ""
    return option(default, f"Calibration text: {SOURCES_HELP}{extra}.")


def nsamples_option(default: Optional[int], when_none: str = "every block of the text"):
    return option(default, "Calibration blocks" + (f" [default: {when_none}]." if default is None else "."))


def seq_len_option(default: int = 2048):
    return option(default, "Tokens per calibration block.")


def load_texts(source: str, split: str = "train") -> tuple[list[str], str]:
    """Return the non-empty text lines of ``source`` and a one-line description of them."""
    if source in BUNDLED:
        path = BUNDLED[source]
        return _read_txt(path), f"{source} ({path.name}: Jargon File 4.4.7 excerpt, public domain)"
    if source in HUB:
        return _load_hub(source, split)
    path = Path(source).expanduser()
    if path.suffix in (".txt", ".jsonl", ".json") or path.exists():
        if not path.is_file():
            raise GmcError(f"text file not found: {source}")
        lines = _read_jsonl(path) if path.suffix in (".jsonl", ".json") else _read_txt(path)
        if not lines:
            raise GmcError(f"text file {source} holds no text")
        return lines, f"{path} ({'jsonl, text field' if path.suffix in ('.jsonl', '.json') else 'text'})"
    raise GmcError(f"unknown text source {source!r}: expected {SOURCES_HELP}")


def _read_txt(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise GmcError(f"{path} is not UTF-8 text") from error
    return [line for line in text.splitlines() if line.strip()]


def _read_jsonl(path: Path) -> list[str]:
    lines = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as error:
            raise GmcError(f"{path}:{number} is not valid JSON ({error.msg})") from error
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise GmcError(f"{path}:{number} has no string field 'text'")
        if record["text"].strip():
            lines.append(record["text"])
    return lines


def _load_hub(source: str, split: str) -> tuple[list[str], str]:
    rows, description = hub_rows(source, split)
    return [text for text in rows if text.strip()], description


def hub_rows(source: str, split: str, instead: str = "'bundled', or 'self'") -> tuple[list[str], str]:
    """Every row of a hub dataset's split (empty ones included) and a description.

    Offline, one GmcError that suggests a local path or ``instead``.
    """
    spec = HUB[source]
    if split not in spec.splits:
        raise GmcError(f"{source} has no split {split!r}: expected one of {', '.join(spec.splits)}")
    try:
        import datasets

        kwargs = {"data_files": spec.data_files} if spec.data_files else {}
        data = datasets.load_dataset(spec.path, spec.name, split=split, **kwargs)
    except Exception as error:  # datasets raises connection, file and value errors alike offline
        raise GmcError(
            f"cannot load hub dataset {source!r} ({spec.path}, split {split}): hub unreachable or not "
            f"cached; pass a local .txt/.jsonl path, {instead}"
        ) from error
    return list(data[spec.column]), f"{source} ({spec.path}/{spec.name or ''} {split})"


def token_blocks(tokenizer, lines: list[str], seq_len: int, nsamples: int | None, seed: int) -> torch.Tensor:
    """``[n, seq_len]`` int64 blocks: lines tokenised with BOS, packed, shuffled by ``seed``
    (``seq_len`` as its caller's config, or ``calibration_blocks``, checked it)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    stream: list[int] = []
    for line in lines:
        if bos is not None:
            stream.append(bos)
        stream.extend(tokenizer(line, add_special_tokens=False)["input_ids"])
        if nsamples is not None and len(stream) >= 4 * nsamples * seq_len:
            break  # enough to shuffle from; avoids tokenising a whole corpus for a few blocks
    count = len(stream) // seq_len
    if count == 0:
        raise GmcError(f"text too short: {len(stream)} tokens, one block needs --seq-len {seq_len}")
    blocks = torch.tensor(stream[: count * seq_len], dtype=torch.int64).view(count, seq_len)
    order = list(range(count))
    random.Random(seed).shuffle(order)
    if nsamples is not None:
        order = order[:nsamples]
    return blocks[order]


def described_blocks(loaded, lines: Optional[tuple[list[str], str]], seq_len: int, nsamples: Optional[int],
                     seed: int) -> tuple[torch.Tensor, str]:
    """``[n, seq_len]`` calibration token blocks and their description: of ``lines`` (``load_texts``'s
    lines and description), or sampled from ``loaded``'s model when None (``self_generated_blocks``)."""
    if lines is None:
        return (self_generated_blocks(loaded, nsamples, seq_len, seed),
                f"self (sampled from the dense model, seed {seed})")
    text, description = lines
    blocks = token_blocks(loaded.tokenizer, text, seq_len, nsamples, seed)
    return blocks, f"{description}; {blocks.shape[0]} blocks x {blocks.shape[1]} tokens"


@torch.no_grad()
def self_generated_blocks(loaded, nsamples: int, seq_len: int, seed: int) -> torch.Tensor:
    """Data-free calibration: ``[n, seq_len]`` sequences sampled from the dense model itself.

    Each sequence starts at BOS and is sampled at temperature 1 (no top-k/top-p), so the blocks
    follow the model's own distribution. Cached under ``$GMC_CACHE/self/`` keyed by the model
    fingerprint, count, length and seed, since sampling is the slow part.
    """
    cache = cache_root() / "self"
    key = f"{model_fingerprint(loaded.model)}-{nsamples}x{seq_len}-seed{seed}.pt"
    if (cache / key).is_file():
        try:  # weights_only: a planted pickle in the cache is refused, never run
            blocks = torch.load(cache / key, map_location="cpu", weights_only=True)
        except Exception as error:
            blocks = error
        if isinstance(blocks, torch.Tensor) and blocks.dim() == 2 and blocks.shape[0] == nsamples \
                and not blocks.is_floating_point():
            return blocks
        warnings.warn(f"ignoring the unreadable self-calibration cache {cache / key}; sampling again",
                      RuntimeWarning, stacklevel=2)
    model, tokenizer = loaded.model, loaded.tokenizer
    start = getattr(tokenizer, "bos_token_id", None)
    if start is None:
        start = getattr(tokenizer, "eos_token_id", 0)
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    rows = []
    from tqdm.auto import tqdm

    for _ in tqdm(range(nsamples), desc="sampling self-calibration", unit="seq"):
        prompt = torch.tensor([[start]], device=device)
        out = model.generate(prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_length=seq_len, min_length=seq_len, pad_token_id=start)
        rows.append(out[0, :seq_len].cpu())
    blocks = torch.stack(rows)
    import io

    buffer = io.BytesIO()
    torch.save(blocks, buffer)
    atomic_write_bytes(cache / key, buffer.getvalue())
    return blocks


def calibration_blocks(tokenizer, source: str = "bundled", nsamples: int | None = 128, seq_len: int = 512,
                       seed: int = 42) -> torch.Tensor:
    """``[nsamples, seq_len]`` token ids of calibration text ``source`` (``load_texts``: bundled,
    wikitext2, alpaca, a local file), for ``gmc.prune_``; ``nsamples`` None: every block."""
    check_seq_len(seq_len)
    lines, _ = load_texts(source, split="train")
    return token_blocks(tokenizer, lines, seq_len, nsamples, seed)
