"""Triton compiles each kernel variant at its first launch, one at a time in a process (1.7 s a variant for sm_90
on the 2-core CPU machine: `bench/triton_compile_report.py` compiles its 81 in 141 s), so a GPU benchmark of many
variants is compile-bound. `run_untimed` runs a benchmark's own pieces first, untimed and several processes at a
time: their compiles land in Triton's on-disk cache (each file written under a temporary name and renamed, so
processes can share it), and the timed runs after them load the kernels from it instead of compiling.

As a program it runs several benchmarks' untimed pieces in one pool (gpu_session.sh's targets stage), so the
pieces of one benchmark do not wait for another's to finish before they start:

    python bench/attention_speed.py ARGS --print-untimed >  pieces.jsonl
    python bench/model_speed.py ARGS --print-untimed     >> pieces.jsonl
    python bench/compile_first.py pieces.jsonl --workers 10
    python bench/attention_speed.py ARGS --compile-workers 0   # the timed runs, kernels already in the cache
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from time_limit import STOPPED_STATUS, stop_on_sigterm, stopped_note

DEFAULT_WORKERS = 8  # processes at a time on a GPU machine (16 cores there); each child ~2-3 GB of GPU memory


def workers_for(requested: int | None, device_type: str) -> int:
    """``--compile-workers``: as asked, else DEFAULT_WORKERS on CUDA and 0 elsewhere (Triton's interpreter on the
    CPU compiles nothing)."""
    return requested if requested is not None else DEFAULT_WORKERS if device_type == "cuda" else 0


def run_untimed(commands: list[list[str]], env: dict, workers: int, timeout: float = 240) -> str:
    """Runs ``commands`` ``workers`` at a time, output dropped, each stopped after ``timeout`` seconds (a hung
    piece must not eat the time its timed run needs); one line saying what ran, how long it took, and how many
    failed or were stopped. Those only cost time: their timed runs compile what they still need, and fail again,
    saying why, where they failed here. Stopped itself (SIGTERM from a time limit, see time_limit.py, or Ctrl-C),
    it kills its pieces, says so and exits: the benchmark has no rows yet."""
    start = time.perf_counter()
    running = set()

    def run(command: list[str]) -> str:
        try:
            proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:  # a piece that cannot start (no such program) fails like one that exits badly
            return "failed"
        with proc:
            running.add(proc)
            try:
                return "ok" if proc.wait(timeout) == 0 else "failed"
            except subprocess.TimeoutExpired:
                proc.kill()
                return "stopped"
            finally:
                running.discard(proc)

    pool = concurrent.futures.ThreadPoolExecutor(workers)
    try:
        outcomes = list(pool.map(run, commands))
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(running):
            proc.kill()
        print(stopped_note("the untimed compile pass"), flush=True)
        sys.exit(STOPPED_STATUS)
    pool.shutdown()
    trouble = [f"{outcomes.count(o)} {o}" + (f" at {timeout:.0f} s" if o == "stopped" else "")
               for o in ("failed", "stopped") if o in outcomes]
    plural = "" if len(commands) == 1 else "es"
    return (f"# compiled first: {len(commands)} process{plural} untimed, {min(workers, len(commands))} at a time, in "
            f"{time.perf_counter() - start:.0f} s" + (f" ({', '.join(trouble)})" if trouble else ""))


def print_commands(commands: list[list[str]]) -> None:
    """A benchmark's untimed pieces for this module's program: one JSON list of arguments a line."""
    for command in commands:
        print(json.dumps(command))


def read_commands(paths: list[Path]) -> list[list[str]]:
    """The pieces of ``print_commands``'s files, in order, each once; a line that is not a JSON list of strings is
    an error naming its file and line."""
    commands = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                command = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not (isinstance(command, list) and command and all(isinstance(a, str) for a in command)):
                raise ValueError(f"{path}:{number}: not a list of arguments")
            if command not in commands:
                commands.append(command)
    return commands


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="files of --print-untimed's lines")
    ap.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="processes at a time (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds before a piece is stopped (default %(default)s)")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    if not args.timeout > 0:
        ap.error(f"--timeout must be positive (seconds before a piece is stopped), got {args.timeout:g}")
    missing = [str(p) for p in args.files if not p.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    try:
        commands = read_commands(args.files)
    except ValueError as error:
        ap.error(str(error))
    stop_on_sigterm()
    if not commands:
        print("# compiled first: nothing to compile (no untimed pieces)")
        return 0
    print(run_untimed(commands, dict(os.environ), args.workers, args.timeout), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
