"""Errors that the CLI turns into one line on stderr and a non-zero exit code."""


class StructinitError(Exception):
    """A problem the user can fix; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UsageError(StructinitError, ValueError):
    """Impossible or inconsistent settings (CLI exit code 2)."""

    exit_code = 2


class ArtifactError(StructinitError):
    """An artifact file that is missing, truncated, corrupt or of another format."""

    exit_code = 1
