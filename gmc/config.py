"""What every config dataclass shares: its fields' CLI declarations (``option``: default, help and
allowed values in one place, from which ``gmc.cli.options`` generates the click options), the options
every model-loading command takes (``--device``, ``--dtype``, ``-o/--output``, ...), reading a field's
default, and the common range checks, each with gmc's one-line error; gmc's version and cache directory."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from gmc.errors import GmcError

__version__ = "0.1.0"
MIN_SEQ_LEN = 2  # a calibration or evaluation block needs an input token and a next token
AUTO = "auto"  # --device / --dtype: the accelerator when there is one, and its dtype
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def option(default=dataclasses.MISSING, help: str = "", *, choices=None, flag: str | None = None,
           short: str | None = None, metavar: str | None = None, optional: bool = False,
           factory=dataclasses.MISSING):
    """A config field together with its command-line option: ``help``, the allowed ``choices``, and
    the spelling when it is not ``--field-name`` (``flag``, and a one-letter ``short``). The default is
    the field's: ``gmc.cli.options`` shows it, so it is written nowhere else. ``optional``: leaving the
    option out means something of its own to the command (``gmc eval`` without ``--tasks`` runs no
    tasks), so the command line's default is None."""
    cli = {"help": help, "choices": None if choices is None else tuple(choices), "flag": flag, "short": short,
           "metavar": metavar, "optional": optional}
    return dataclasses.field(default=default, default_factory=factory, metadata={"cli": cli})


def device_option():
    return option(AUTO, "auto: cuda when available, else cpu (or cpu, cuda, cuda:N, mps).", metavar="DEVICE")


def dtype_option(help: str = "auto: bfloat16 on CUDA, float32 on CPU."):
    return option(AUTO, help, choices=(AUTO, *DTYPE_NAMES))


def output_option(help: str):
    return option(None, help, short="-o")


def overwrite_option(what: str = "output at -o"):
    return option(False, f"Replace an existing {what} that gmc wrote.")


def seed_option():
    return option(42, "Seed of the calibration sample and of training.")


def trust_remote_code_option():
    return option(False, "Let transformers run the model repository's own Python code.")


def base_model_option():
    return option(None, "Dense base model of a masks artifact [default: the one its manifest names].")


def default_of(config_cls: type, name: str):
    """The default of field ``name`` of the dataclass ``config_cls`` (KeyError for no such field)."""
    for field in dataclasses.fields(config_cls):
        if field.name == name:
            return field.default
    raise KeyError(name)


def passed(config, names) -> list[str]:
    """Those of the fields ``names`` of ``config`` that differ from their default: the options a user
    passed (every default is a plain value, so passing a default is the same as leaving it out)."""
    return [name for name in names if getattr(config, name) != default_of(type(config), name)]


def refuse_passed(config, names, why: str) -> None:
    """A ``GmcError`` for the first of ``names`` passed to ``config`` (``passed``): ``"{option} {why}"``,
    the option spelled as on the command line (``--no-x`` for a flag passed off)."""
    given = passed(config, names)
    if not given:
        return
    field = next(f for f in dataclasses.fields(config) if f.name == given[0])
    flag = (field.metadata.get("cli") or {}).get("flag") or "--" + field.name.replace("_", "-")
    if field.default is True:
        flag = "--no-" + flag.removeprefix("--")
    raise GmcError(f"{flag} {why}")


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
