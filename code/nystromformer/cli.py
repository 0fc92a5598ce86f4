"""The ``nystromformer`` command. Each module below adds its own subcommands with ``add_commands``."""
from __future__ import annotations

import argparse
import errno
import importlib
import sys
from typing import List, Optional

from .errors import UserError

COMMAND_MODULES = [
    "nystromformer.pretrain",
    "nystromformer.validate",
    "nystromformer.plots",
    "nystromformer.demo",
    "nystromformer.data.commands",
    "nystromformer.glue.commands",
    "nystromformer.lra.commands",
    "nystromformer.interop",
]


WARNING_PREFIX = "warning: "


def say(line: str) -> None:
    """A command's console line: warnings (``warning: ...``) on stderr, with errors and progress bars, so they still
    show when stdout goes to a file; the rest on stdout. Flushed, so the two streams interleave in order."""
    stream = sys.stderr if line.startswith(WARNING_PREFIX) else sys.stdout
    stream.write(line + "\n")  # one write: print's separate newline let a parallel sweep's lines run together
    stream.flush()


def add_subcommand(subparsers, name: str, help: str, doc: str, add_arguments, run, check=None) -> None:
    """Register a subcommand whose flags come from ``add_arguments`` and whose work is ``run(args)``; ``check(args)``,
    when given, is the part of ``run`` that checks the arguments alone (nothing read, written or run; see
    ``validate_args``)."""
    p = subparsers.add_parser(name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run, check=check)


# The file system refusing a write: the user's to fix (a folder mounted read-only, no permission, a full disk),
# reported as one line naming the file (a write, or a read the permissions refuse). Other OSErrors stay tracebacks.
UNWRITABLE = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
              errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the device",
              errno.EDQUOT: "disk quota exceeded"}


def run_command(run, args: argparse.Namespace) -> int:
    """``run(args)``'s exit status; a UserError is one ``error: ...`` line on stderr and status 2, and so is a
    write the file system refuses. Ctrl-C that a command does not handle itself ends with status 130 and one
    line, no traceback (the commands write their files atomically, so a rerun finds none half-written)."""
    try:
        return int(run(args) or 0)
    except UserError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in UNWRITABLE:
            raise
        where = e.filename if e.filename is not None else "a file"
        refused = e.errno in (errno.EACCES, errno.EPERM)
        hint = ("an input this user can read, or an output folder this user can write to" if refused
                else "an output folder with room, that this user can write to")
        print(f"error: {where}: {UNWRITABLE[e.errno]}; it needs {hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C); rerun the same command to resume where it can, or to start again",
              file=sys.stderr)
        return 130


def script_main(prog: str, doc: str, add_arguments, run, argv: Optional[List[str]] = None) -> int:
    """The same command as a stand-alone script (the paper's ``code/run_*.py`` entry points)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_command(run, parser.parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nystromformer", description="Nyströmformer pipeline: data preprocessing, pretraining, validation, GLUE, "
        "transformers interop, LRA ListOps and the demo. `nystromformer COMMAND --help` for each; README.md and "
        "docs/ for the workflows. A user's mistake prints one `error:` line and exits with status 2.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The command's own checks of its arguments, alone: what ``DRY_RUN=1 bash bench/gpu_session.sh`` runs in place
    of the command (bench/gpu_session_dry_run.py), with the command's ``error:`` line and status 2. The command
    makes the same checks when it runs."""
    check = getattr(args, "check", None)

    def checked(args) -> int:
        check(args)  # its result is the command's plan, not a status
        return 0

    if check is not None and run_command(checked, args) != 0:
        parser.exit(2)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
