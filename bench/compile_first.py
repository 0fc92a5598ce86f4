"""Triton compiles each kernel variant at its first launch, one at a time in a process (1.7 s a variant for sm_90
on the 2-core CPU machine: `bench/triton_compile_report.py` compiles its 81 in 141 s), so a GPU benchmark of many
variants is compile-bound. `run_untimed` runs a benchmark's own pieces first, untimed and several processes at a
time: their compiles land in Triton's on-disk cache (each file written under a temporary name and renamed, so
processes can share it), and the timed runs after them load the kernels from it instead of compiling."""
import concurrent.futures
import subprocess
import sys
import time

from time_limit import STOPPED_STATUS, stopped_note

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
        with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
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
    return (f"# compiled first: {len(commands)} process{plural} untimed, {workers} at a time, in "
            f"{time.perf_counter() - start:.0f} s" + (f" ({', '.join(trouble)})" if trouble else ""))
