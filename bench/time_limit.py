"""A benchmark stopped at its time limit keeps the rows it measured, and one failing row does not lose the others.

gpu_session.sh stops a command at its limit with `timeout`'s SIGTERM (SIGKILL 20 s later). A script that gathers
its table's rows and prints them at the end would lose them all, and device time is scarce. ``stop_on_sigterm()``
makes SIGTERM raise KeyboardInterrupt, as Ctrl-C does; the scripts catch it around their measuring loop, print the
rows measured so far with ``stopped_note``, and exit with STOPPED_STATUS. A row that raises is recorded by
``failure`` and named under the table (exit status 1), and the next row is measured."""
import signal
import sys

STOPPED_STATUS = 130


def stop_on_sigterm() -> None:
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, interrupt)


def stopped_note(where: str) -> str:
    return f"\nStopped (a time limit or Ctrl-C) during {where}: the rows above are those measured before it."


def failure(where: str, error: BaseException) -> str:
    """One line for the notes under a table: where, the exception's type and its message's first line."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{where}: {type(error).__name__}: {first}"


def finish(failures: list, stopped, label: str = "Failed (its row is n/a)") -> None:
    """The end of a benchmark's output: each failure under the table, then the stop note and exit 130 when it was
    stopped (``stopped`` names the row under way), else exit 1 when a row failed; returns when neither."""
    for note in failures:
        print(f"\n{label}: {note}")
    if stopped:
        print(stopped_note(stopped))
        sys.exit(STOPPED_STATUS)
    if failures:
        sys.exit(1)
