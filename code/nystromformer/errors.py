"""The one kind of error a command reports as the user's: ``cli`` prints it as one ``error: ...`` line and exits 2.
Every such error type (ConfigError, ShardError, CheckpointError, GlueDataError, ...) subclasses UserError;
anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """A user's mistake (a missing or malformed file, a bad key or flag value) or a run that cannot go on as
    asked (a diverged loss); the message names the file, key or flag and says what to do."""


def first_undecodable_line(path) -> int:
    """The 1-based number of the first line of ``path`` that is not UTF-8 (for an error message: a decoder's
    error from a buffered text read gives no line), or 0 when every line decodes."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0
