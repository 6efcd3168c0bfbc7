"""What every config dataclass shares: reading a field's default (the one definition the CLI shows)
and the common range checks, each with gmc's one-line error; gmc's version and cache directory."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from gmc.errors import GmcError

__version__ = "0.1.0"
MIN_SEQ_LEN = 2  # a calibration or evaluation block needs an input token and a next token


def default_of(config_cls: type, name: str):
    """The default of field ``name`` of the dataclass ``config_cls`` (KeyError for no such field)."""
    for field in dataclasses.fields(config_cls):
        if field.name == name:
            return field.default
    raise KeyError(name)


def check_at_least(option: str, value, minimum: int) -> None:
    """``value`` must be an integer >= ``minimum``; ``option`` is its CLI spelling (``--seq-len``)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise GmcError(f"bad {option} {value!r}: must be an integer >= {minimum}")


def check_seq_len(seq_len) -> None:
    check_at_least("--seq-len", seq_len, MIN_SEQ_LEN)


def check_positive(config, *names: str) -> None:
    """Each field ``names`` of ``config`` (a rate, a weight, a temperature) is positive and finite."""
    for name in names:
        value = getattr(config, name)
        if not (value > 0 and math.isfinite(value)):
            raise GmcError(f"bad --{name.replace('_', '-')} {value}: must be positive and finite")


def cache_root() -> Path:
    """Where gmc keeps what it can rebuild (converted models, self-generated text, compiled kernels):
    ``$GMC_CACHE``, default ``~/.cache/gmc``."""
    return Path(os.environ.get("GMC_CACHE", Path.home() / ".cache" / "gmc")).expanduser()
