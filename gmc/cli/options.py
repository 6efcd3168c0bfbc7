"""Click options generated from config dataclasses: each option is declared once, on its field.

A field made with ``gmc.config.option`` carries its help, allowed values and spelling; its default
and type are the field's own. ``options(Config)`` turns every such field into a click option
(``--seq-len`` for ``seq_len``; a ``bool`` defaulting to False is a flag, one defaulting to True a
``--x/--no-x`` pair, and so is an ``optional`` one, None when neither is given) and ``build(Config,
values)`` makes the config from the parsed values, so a command reads: arguments, ``@options(...)``,
then one library call.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, Iterable

import click

_CLICK_TYPES = {int: int, float: float, str: str}


def cli_fields(config_cls: type, skip: Iterable[str] = ()) -> list[dataclasses.Field]:
    """The fields of ``config_cls`` that declare a command-line option, in declaration order."""
    skipped = set(skip)
    return [f for f in dataclasses.fields(config_cls) if "cli" in f.metadata and f.name not in skipped]


def options(config_cls: type, skip: Iterable[str] = (), required: Iterable[str] = ()) -> Callable:
    """A decorator adding the options of ``config_cls``'s fields (but ``skip``) to a click command;
    those named in ``required`` must be given."""
    hints = typing.get_type_hints(config_cls)
    needed = set(required)
    declared = [_option(field, hints[field.name], field.name in needed) for field in cli_fields(config_cls, skip)]

    def decorate(command: Callable) -> Callable:
        for declare in reversed(declared):  # click lists options in decorator order, top first
            command = declare(command)
        return command

    return decorate


def build(config_cls: type, values: dict[str, Any], **given) -> Any:
    """``config_cls`` from the parsed options in ``values`` (those that are its fields) and ``given``."""
    names = {f.name for f in dataclasses.fields(config_cls) if f.init}
    return config_cls(**{name: value for name, value in values.items() if name in names and name not in given},
                      **given)


def _option(field: dataclasses.Field, hint, required: bool) -> Callable:
    cli = field.metadata["cli"]
    flag = cli["flag"] or "--" + field.name.replace("_", "-")
    names = [cli["short"], flag] if cli["short"] else [flag]
    default = None if field.default is dataclasses.MISSING or cli["optional"] else field.default
    kind = _value_type(hint)
    settings: dict[str, Any] = {"help": cli["help"], "metavar": cli["metavar"]}
    if kind is bool:
        if cli["optional"]:  # --x/--no-x, None when neither is given: the command decides
            return click.option(f"{flag}/--no-{flag.removeprefix('--')}", field.name, default=None, **settings)
        if default:
            names = [f"{flag}/--no-{flag.removeprefix('--')}"]
            settings.update(default=True, show_default=True)
        else:
            settings.update(is_flag=True, default=False)
        return click.option(*names, field.name, **settings)
    if cli["choices"] is not None:
        settings["type"] = click.Choice(cli["choices"])
    elif kind in _CLICK_TYPES:
        settings["type"] = _CLICK_TYPES[kind]
    settings.update(default=default, show_default=default is not None, required=required)
    return click.option(*names, field.name, **settings)


def _value_type(hint) -> type:
    """``int`` for ``int``, ``Optional[int]`` and ``int | None``; the hint itself otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return kinds[0] if len(kinds) == 1 else str
    return hint
