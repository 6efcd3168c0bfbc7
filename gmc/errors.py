"""The one exception type for user-facing errors.

The CLI prints a ``GmcError`` as a single line and exits with code 2; library users catch it.
Its message names the bad value and what is allowed.
"""
from __future__ import annotations


class GmcError(Exception):
    """A user-facing error: bad input, a missing file, an artifact that does not match."""


class Interrupted(GmcError):
    """Ctrl-C (SIGINT) or SIGTERM during a long run, after its checkpoint was saved; the CLI exits with
    128 + ``signum`` (130, 143)."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum
