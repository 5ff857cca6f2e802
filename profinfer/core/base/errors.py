"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class ProfinferError(Exception):
    """A problem the user can act on; str(e) is the whole message, one line."""

    exit_code = 1


class NotRootError(ProfinferError):
    exit_code = 77  # EX_NOPERM


class OutputFailed(ProfinferError):
    exit_code = 74  # EX_IOERR: distinct from a verdict a command's exit code gives (diff's gate)
