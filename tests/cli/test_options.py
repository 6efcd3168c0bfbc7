"""Options are declared once, on config fields: the commands' click options are generated from them."""
from __future__ import annotations

import dataclasses
from typing import Optional

import click
import pytest
from click.testing import CliRunner

from gmc.cli.main import cli
from gmc.cli.options import build, cli_fields, options
from gmc.config import AUTO, option
from gmc.errors import GmcError

MODEL_COMMANDS = ("prune", "eval", "generate", "lower", "recover", "reconstruct")


@dataclasses.dataclass
class _Example:
    name: str
    count: int = option(3, "How many.")
    ratio: Optional[float] = option(None, "A fraction.")
    kind: str = option("a", "Which kind.", choices=("a", "b"), flag="--sort")
    verbose: bool = option(False, "Say more.")
    cache: bool = option(True, "Keep a cache.")
    output: Optional[str] = option(None, "Where.", short="-o")
    hidden: int = 7  # no CLI declaration: not an option

    def __post_init__(self):
        if self.count < 0:
            raise GmcError(f"bad --count {self.count}")


def _example_command():
    @click.command()
    @click.argument("name")
    @options(_Example, skip=("name",), required=("output",))
    def command(name, **values):
        click.echo(repr(build(_Example, values, name=name)))

    return command


def test_generated_options_take_the_fields_defaults_types_choices_and_spellings():
    command = _example_command()
    params = {p.name: p for p in command.params}
    assert set(params) == {"name", "count", "ratio", "kind", "verbose", "cache", "output"}
    assert params["count"].default == 3 and params["count"].type is click.INT
    assert params["ratio"].default is None and params["ratio"].type is click.FLOAT
    assert params["kind"].opts == ["--sort"] and params["kind"].type.choices == ("a", "b")
    assert params["verbose"].is_flag and params["cache"].secondary_opts == ["--no-cache"]
    assert params["output"].opts == ["-o", "--output"] and params["output"].required
    result = CliRunner().invoke(command, ["x", "-o", "out", "--count", "5", "--sort", "b",
                                                         "--verbose", "--no-cache"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == repr(_Example("x", 5, None, "b", True, False, "out"))


def test_help_shows_the_fields_default_once():
    result = CliRunner().invoke(_example_command(), ["--help"])
    assert "How many.  [default: 3]" in result.output and "--hidden" not in result.output


def _commands() -> dict[str, click.Command]:
    return dict(cli.commands)


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_option_has_help_and_appears_once(name):
    command = _commands()[name]
    options_ = [p for p in command.params if isinstance(p, click.Option)]
    spellings = [opt for p in options_ for opt in p.opts + p.secondary_opts]
    assert len(spellings) == len(set(spellings)), f"gmc {name} declares an option twice"
    assert len({p.name for p in options_}) == len(options_)
    assert all(p.help for p in options_ if p.name != "help"), f"gmc {name} has an option without help"


@pytest.mark.parametrize("name", MODEL_COMMANDS)
def test_model_commands_share_device_dtype_and_output(name):
    params = {p.name: p for p in _commands()[name].params}
    assert params["device"].default == AUTO and params["dtype"].default == AUTO
    assert "auto" in params["dtype"].type.choices
    if "output" in params:
        assert params["output"].opts == ["-o", "--output"]
    assert name == "generate" or "output" in params


def test_every_cli_field_of_the_prune_configs_is_an_option():
    from gmc.masks.learn import LearnConfig
    from gmc.masks.prune import PruneConfig

    params = {p.name for p in _commands()["prune"].params}
    for config in (PruneConfig, LearnConfig):
        assert {f.name for f in cli_fields(config)} <= params
