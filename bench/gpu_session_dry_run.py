"""The python of ``DRY_RUN=1 bash bench/gpu_session.sh STAGE…``: each command a stage would run on the GPU is
checked here instead of run, so a misspelt flag, a removed choice or a renamed test is found on this machine in
seconds, not in the device's few minutes (15 a session).

    python bench/X.py ARGS    the script's own argparse parses ARGS, then its ``validate_args(ap, args)`` when it
                              has one (checks between arguments); the script stops there
    python -m pytest ARGS     pytest collects what ARGS select (``--collect-only``): every test named exists and is
                              selected, every ``--deselect`` names a collected test, at least one test is selected
    python -m MODULE ARGS     as a script, for a module run as a program (``nystromformer.cli``)
    python -c CODE            not run (said so)

A command's ``env K=V`` settings reach it as they would on the device.

Each prints one line on stderr, ``dry run ok: …`` or ``dry run FAILED: …`` after the tool's own message, and exits
0 or 1. Only a script's module level and its ``main`` up to ``parse_args`` run: every bench script parses its
arguments before it does anything else.
"""
import argparse
import runpy
import shlex
import sys
from pathlib import Path

import pytest


class _Parsed(Exception):
    """Raised from the script's ``parse_args``: its arguments were accepted and nothing else is to run."""


def _stop_after_parsing() -> None:
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        parsed = original(self, args, namespace)
        validate = sys._getframe(1).f_globals.get("validate_args")  # the caller's module: the script's main
        if validate is not None:
            validate(self, parsed)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_args


def check_program(label: str, run) -> bool:
    """Runs ``run`` (the script or module as ``__main__``) until its arguments are parsed."""
    _stop_after_parsing()
    try:
        run()
    except _Parsed:
        return True
    except SystemExit as exc:  # argparse's error (2) after its own message, or --help
        print(f"{label}: exited with status {exc.code} while parsing its arguments", file=sys.stderr)
        return False
    except Exception as exc:  # a validate_args that raised instead of calling ap.error
        print(f"{label}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return False
    print(f"{label}: finished without parsing any arguments (it would have run for real)", file=sys.stderr)
    return False


class _Collected:
    """A pytest plugin that keeps every collected test's id, before ``-m`` / ``-k`` / ``--deselect`` remove any,
    and the selected ones' after."""

    def __init__(self):
        self.ids: list[str] = []
        self.selected: list[str] = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items):
        self.ids = [item.nodeid for item in items]

    def pytest_collection_finish(self, session):
        self.selected = [item.nodeid for item in session.items]


def check_pytest(args: list[str]) -> bool:
    deselected = [a.split("=", 1)[1] for a in args if a.startswith("--deselect=")]
    deselected += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--deselect"]
    collected = _Collected()
    status = pytest.main([*args, "--collect-only", "-qq"], plugins=[collected])
    if status != 0:  # 4: a named test or file not found; 5: nothing selected; 2: an error while collecting
        print(f"pytest {shlex.join(args)}: collecting exited with status {int(status)}", file=sys.stderr)
        return False
    good = True
    for wanted in deselected:  # pytest drops a --deselect that matches nothing without a word
        if not any(test.startswith(wanted) for test in collected.ids):  # pytest's own match: a prefix
            print(f"--deselect {wanted}: no such test was collected", file=sys.stderr)
            good = False
    named = [a for i, a in enumerate(args) if "::" in a and not a.startswith("-") and args[i - 1] != "--deselect"]
    for test in named:  # a test named by its id and then left out by -m or -k: a mistake, not a choice
        if not any(t == test or t.startswith(test + "[") for t in collected.selected):
            print(f"{test}: named but not selected (by -m, -k or --deselect)", file=sys.stderr)
            good = False
    return good


def main(argv: list[str]) -> int:
    command = list(argv)
    label = shlex.join(command)
    if command[:1] == ["-c"]:
        print("dry run: python -c … (not run: code, not a script's arguments)", file=sys.stderr)
        return 0
    if command[:2] == ["-m", "pytest"]:
        good = check_pytest(command[2:])
    elif command[:1] == ["-m"] and len(command) > 1:
        sys.argv = [command[1], *command[2:]]
        good = check_program(label, lambda: runpy.run_module(command[1], run_name="__main__", alter_sys=True))
    elif command and command[0].endswith(".py") and Path(command[0]).is_file():
        sys.argv = command
        sys.path.insert(0, str(Path(command[0]).resolve().parent))  # as `python bench/X.py` puts bench/ first
        good = check_program(label, lambda: runpy.run_path(command[0], run_name="__main__"))
    elif command and command[0].endswith(".py"):
        print(f"{command[0]}: no such script", file=sys.stderr)
        good = False
    else:
        print(f"{label}: not a script, `-m MODULE` or `-c CODE`", file=sys.stderr)
        good = False
    # on stderr: the stages send a table's stdout to its file, and some filter it (`| grep`)
    print(f"dry run {'ok' if good else 'FAILED'}: {label}", file=sys.stderr)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
