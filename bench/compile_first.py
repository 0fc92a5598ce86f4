"""Triton compiles each kernel variant at its first launch, one at a time in a process (about a second each on
the H100's host), so a GPU benchmark of many variants is compile-bound. `run_untimed` runs a benchmark's own
pieces first, untimed and several processes at a time: their compiles land in Triton's on-disk cache (each file
written to a temporary name and renamed, so processes can share it), and the timed runs after them load the
kernels from it instead of compiling."""
import concurrent.futures
import subprocess
import time


def run_untimed(commands: list[list[str]], env: dict, workers: int) -> str:
    """Runs ``commands`` ``workers`` at a time, output dropped; one line saying what ran, how long it took and
    how many failed (a piece that fails here fails again in its timed run, which says why)."""
    start = time.perf_counter()

    def run(command: list[str]) -> int:
        return subprocess.run(command, env=env, capture_output=True).returncode

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        failed = sum(code != 0 for code in pool.map(run, commands))
    return (f"# compiled first: {len(commands)} processes untimed, {workers} at a time, in "
            f"{time.perf_counter() - start:.0f} s" + (f" ({failed} failed: their rows say why)" if failed else ""))
