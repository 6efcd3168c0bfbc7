"""``gmc`` click group and the one-line error contract.

Every command builds a config and calls one library function. A ``GmcError`` or a click usage
error prints ``gmc: error: <message>`` on one line and exits with code 2; so does, as a last
resort, an ``OSError`` (full or read-only disk, a path under a file: the line names the file and
the fix) or a ``SafetensorError`` that no boundary check caught. Bad input never shows a
traceback; exit 1 with a traceback is a bug in gmc. Ctrl-C exits 130.
SIGTERM (``kill``, batch schedulers, and the only way to stop a background job, which ignores
SIGINT) is handled like Ctrl-C (a learned run writes its checkpoint) and exits 143.
Warnings print as one ``gmc: warning: <message>`` line.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import warnings

import click
from safetensors import SafetensorError

from gmc.config import __version__
from gmc.errors import GmcError, Interrupted

_stopped_by = signal.SIGINT  # the signal behind a KeyboardInterrupt: 130 = 128 + SIGINT, 143 for SIGTERM


def _terminate(signum, frame) -> None:
    global _stopped_by
    _stopped_by = signum
    raise KeyboardInterrupt


class _OneLineErrors(click.Group):
    def main(self, args=None, prog_name=None, **extra):
        try:
            return super().main(args=args, prog_name=prog_name or "gmc", standalone_mode=False, **extra)
        except click.exceptions.Exit as exit_:
            sys.exit(exit_.exit_code)
        except Interrupted as error:
            click.echo(f"gmc: interrupted; {error}", err=True)
            sys.exit(128 + (error.signum or _stopped_by))
        except (click.exceptions.Abort, KeyboardInterrupt):
            click.echo("gmc: interrupted", err=True)
            sys.exit(128 + _stopped_by)
        except (click.UsageError, click.BadParameter) as error:
            click.echo(f"gmc: error: {error.format_message()}", err=True)
            sys.exit(2)
        except GmcError as error:
            click.echo(f"gmc: error: {error}", err=True)
            sys.exit(2)
        except OSError as error:  # the last resort: most bad paths are refused before any work starts
            click.echo(f"gmc: error: {_os_error_line(error)}", err=True)
            sys.exit(2)
        except SafetensorError as error:
            click.echo(f"gmc: error: a safetensors file is truncated or corrupted ({error}); "
                       f"re-create it", err=True)
            sys.exit(2)


_OS_ERROR_FIX = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some space or write elsewhere",
    errno.EACCES: "check its permissions or choose another path",
    errno.EPERM: "check its permissions or choose another path",
    errno.EROFS: "the filesystem is read-only: choose another path",
    errno.ENOTDIR: "a component of the path is a file, not a directory",
    errno.EISDIR: "it is a directory: name a file",
    errno.ENOENT: "check the path",
    errno.EEXIST: "it exists already: choose another path",
}


def _os_error_line(error: OSError) -> str:
    """``[Errno 28] No space left on device`` -> one line naming the file and what to do."""
    where = " -> ".join(str(name) for name in (error.filename, error.filename2) if name is not None)
    what = error.strerror or type(error).__name__
    fix = _OS_ERROR_FIX.get(error.errno)
    if error.errno == errno.EEXIST and error.filename is not None and os.path.isfile(error.filename):
        fix = "it is a file, not a directory"  # mkdir of a path under a file
    return f"{what}: {where or 'an input or output path'}" + (f" ({fix})" if fix else "")


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gmc")
def cli():
    """gmc: prune Hugging Face causal LMs with learned, layer-adaptive group sparsity.

    \b
    Typical flow:
      gmc prune smollm2-135m --sparsity 0.5 --group 1x64 --calib bundled -o runs/gm
      gmc eval smollm2-135m runs/gm --ppl bundled-heldout
      gmc lower runs/gm --compile -o runs/gm-packed
      gmc generate runs/gm-packed -i
      gmc bench smollm2-135m runs/gm runs/gm-packed -t 1,2
      gmc info runs/gm-packed
      gmc report runs/gm -o runs/gm/report
    """


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"gmc: warning: {message}\n"


def main() -> None:
    warnings.formatwarning = _one_line_warning  # gmc's own warnings read like its errors
    signal.signal(signal.SIGTERM, _terminate)
    cli()


def _register_commands() -> None:
    """Attach the commands; each module imports its library lazily inside the command body
    where the import is heavy, so ``gmc --help`` stays quick."""
    from gmc.cli.bench import bench
    from gmc.cli.env import env
    from gmc.cli.eval import eval_
    from gmc.cli.generate import generate
    from gmc.cli.info import info
    from gmc.cli.lower import lower
    from gmc.cli.prune import prune_command
    from gmc.cli.reconstruct import reconstruct
    from gmc.cli.recover import recover
    from gmc.cli.report import report

    for command in (prune_command, eval_, report, lower, generate, reconstruct, recover, bench, env, info):
        cli.add_command(command)


_register_commands()
