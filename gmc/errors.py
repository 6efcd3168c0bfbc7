"""The one exception type for user-facing errors.

The CLI prints a ``GmcError`` as a single line and exits with code 2; library users catch it.
Its message names the bad value and what is allowed.
"""


class GmcError(Exception):
    """A user-facing error: bad input, a missing file, an artifact that does not match."""


class Interrupted(GmcError):
    """Ctrl-C during a long run, after its checkpoint was saved; the CLI exits with code 130."""
