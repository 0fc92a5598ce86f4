"""Time and peak memory per instance versus sequence length, for every attention type, in one run.

Measures one multi-head attention module (Q/K/V/output projections + the attention variant), batch 1,
forward + backward, as the Nyströmformer paper's efficiency table (per-instance time and memory). Prints
one Markdown table; ``--csv`` / ``--plot`` also save it.

Memory:
  * CUDA: ``torch.cuda.max_memory_allocated`` above the memory already allocated before the pass (inputs
    and weights excluded) — the allocator's exact peak of tensor memory.
  * CPU: peak resident-set growth of this process during the pass: ``/proc/self/clear_refs`` resets the
    kernel's high-water mark (VmHWM), then VmHWM − VmRSS(before). glibc is told to serve every block over
    64 KiB by mmap and freed memory is trimmed before each pass, so freed tensors leave RSS and do not
    hide later peaks. It is a process-level measurement: it includes allocator slack, page granularity and
    PyTorch/oneDNN scratch buffers, so small values (a few MB) are noise; it is not comparable to GPU
    numbers. Where clear_refs is not writable the memory column reads n/a.

    .venv/bin/python bench/efficiency_profile.py --max-length 4096 --plot docs/img/efficiency_cpu.png
    python bench/efficiency_profile.py --device cuda --csv eff.csv --plot docs/img/efficiency_gpu.png  # GPU

A cell that raises is a row entry (``OOM`` or ``error``) named under the table with its message, and the run goes
on; out of memory, or a pass over ``--time-limit``, skips the type's longer lengths (``skipped``). Another error
than out of memory makes the exit status 1 (out of memory is where a type stops fitting: a measurement).
Stopped by SIGTERM (gpu_session.sh's time limit) or Ctrl-C, it prints the cells measured so far (exit status 130).
"""
from __future__ import annotations

import argparse
import ctypes
import csv
import gc
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from nystromformer.attention.nystrom_fast import describe_switches  # noqa: E402
from nystromformer.config import ATTENTION_TYPES, ModelConfig  # noqa: E402
from nystromformer.lra.train import LRA_ATTENTION  # noqa: E402
from nystromformer.model import MultiHeadAttention  # noqa: E402
from time_limit import STOPPED_STATUS, failure, stop_on_sigterm, stopped_note  # noqa: E402

# Settings of each variant in the profile: the LRA comparison's.
SETTINGS = LRA_ATTENTION
# How each implementation's memory grows (what the table measures, honestly labelled).
FORM = {
    "softmax": "exact; fused SDPA (O(n²) unless PyTorch picks a flash kernel)",
    "nystrom": "linear O(n·m)",
    "linformer": "linear O(n·k)",
    "performer": "linear O(n·m)",
    "linear": "linear O(n·d)",
    "reformer": "chunked O(r·n·c); LSH hashing O(r·n²/c)",
    "longformer": "banded O(n·w)",
    "bigbird": "block-sparse O(n·(3+g+r)·b)",
    "linformer_revisited": "linear O(n·k)",
}


def _setup_cpu_allocator() -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD: fixed, so big frees go back to the OS
        libc.mallopt(-1, 64 * 1024)   # M_TRIM_THRESHOLD
        _setup_cpu_allocator.libc = libc
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def measure(attn_type: str, n: int, args, device: torch.device, cpu_mem_ok: bool):
    cfg = ModelConfig(max_seq_len=n, embedding_dim=args.num_head * args.head_dim,
                      transformer_dim=args.num_head * args.head_dim, num_head=args.num_head, head_dim=args.head_dim,
                      attn_type=attn_type, dropout_prob=0.0, mixed_precision=False)
    params = dict(SETTINGS.get(attn_type, {}))
    for key in ("linformer_k", "reformer_bucket_size"):  # sequence-sized settings fit short n, as the LRA runner's
        if key in params:
            params[key] = min(params[key], n)
    cfg = replace(cfg, **params)
    cfg.validate()
    torch.manual_seed(0)
    module = MultiHeadAttention(cfg).to(device)
    x = torch.randn(1, n, cfg.transformer_dim, device=device, requires_grad=True)
    mask = torch.ones(1, n, dtype=torch.long, device=device)

    def step():
        module(x, mask).sum().backward()
        module.zero_grad(set_to_none=True)
        x.grad = None

    step()  # warm-up (kernel selection, caches)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    gc.collect()
    mem = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        sync()
        mem = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    elif cpu_mem_ok:
        _setup_cpu_allocator.libc.malloc_trim(0)
        base = _status_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        step()
        mem = max(0, _status_kb("VmHWM") - base) / 1024
    del module, x
    return statistics.median(times) * 1000, mem


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="128,256,512,1024,2048,4096,8192,16384,32768")
    p.add_argument("--max-length", type=int, default=None, help="drop lengths above this (CPU runs)")
    p.add_argument("--attn-types", default=",".join(ATTENTION_TYPES))
    p.add_argument("--num-head", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per cell (median reported)")
    p.add_argument("--time-limit", type=float, default=30.0,
                   help="skip longer lengths of a type once one pass took longer than this (s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--csv", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.max_length:
        lengths = [n for n in lengths if n <= args.max_length]
    types = [t.strip() for t in args.attn_types.split(",") if t.strip()]
    cpu_mem_ok = device.type == "cpu" and _setup_cpu_allocator()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, {os.cpu_count()} cores visible"
    print(f"# attention fwd+bwd per instance (batch 1, {args.num_head} heads x {args.head_dim}), {where}, "
          f"torch {torch.__version__}; cells: time ms / peak memory MB "
          f"({'cuda max_memory_allocated' if device.type == 'cuda' else 'CPU peak RSS growth' if cpu_mem_ok else 'n/a'})"
          + (f"; {describe_switches(device)}" if "nystrom" in types else ""))
    stop_on_sigterm()
    results, failures, out_of_memory, stopped = {}, [], [], None
    try:
        for t in types:
            skip = False
            for n in lengths:
                if skip:
                    results[t, n] = None
                    continue
                stopped = f"{t} at n = {n}"
                try:
                    ms, mb = measure(t, n, args, device, cpu_mem_ok)
                    results[t, n] = (ms, mb)
                    skip = ms / 1000 > args.time_limit
                except Exception as e:  # a failing cell is an entry, not the end of the table
                    oom = isinstance(e, MemoryError) or "out of memory" in str(e).lower()
                    results[t, n] = ("OOM" if oom else "error", None)
                    # out of memory is a measurement (where a type stops fitting), noted; another error a failure
                    (out_of_memory if oom else failures).append(failure(f"{t} at n = {n}", e))
                    skip = oom  # longer lengths need more memory; another error may be this length's alone
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                print(f"  {t} n={n}: {results[t, n]}", file=sys.stderr, flush=True)
        stopped = None
    except KeyboardInterrupt:
        pass  # stopped names the cell under way; the cells measured are printed below
    measured = [t for t in types if any((t, n) in results for n in lengths)]

    def cell(r, missing="—"):
        if r is missing:
            return missing
        if r is None:
            return "skipped"
        if isinstance(r[0], str):
            return r[0]
        return f"{r[0]:.1f} / {'n/a' if r[1] is None else f'{r[1]:.1f}'}"

    print("\n| attention | memory form | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---|---|" + "---|" * len(lengths))
    for t in measured:
        print(f"| {t} | {FORM.get(t, '?')} | " + " | ".join(cell(results.get((t, n), "—")) for n in lengths) + " |")
    for title, lines in (("Out of memory (the type's longer lengths skipped)", out_of_memory),
                         ("Failed cells (exit status 1)", failures)):
        if lines:
            print(f"\n{title}:")
            for line in lines:
                print(f"- {line}")

    if args.csv:  # status: ok, OOM, error, or skipped (a longer length after an OOM or a pass over --time-limit)
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["attn_type", "seq_len", "time_ms", "peak_mem_mb", "status"])
            for (t, n), r in results.items():
                if r is None:
                    w.writerow([t, n, "", "", "skipped"])
                elif isinstance(r[0], str):
                    w.writerow([t, n, "", "", r[0]])
                else:
                    w.writerow([t, n, f"{r[0]:.4f}", "" if r[1] is None else f"{r[1]:.2f}", "ok"])
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for t in measured:
            pts = [(n, results[t, n]) for n in lengths
                   if results.get((t, n)) and not isinstance(results[t, n][0], str)]
            axes[0].plot([n for n, _ in pts], [r[0] for _, r in pts], marker="o", label=t)
            mp = [(n, r[1]) for n, r in pts if r[1] is not None]
            axes[1].plot([n for n, _ in mp], [m for _, m in mp], marker="o", label=t)
        for ax, lab in zip(axes, ("time per instance, fwd+bwd (ms)", "peak memory (MB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.set_ylabel(lab)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"attention module, batch 1, {args.num_head}x{args.head_dim}, {where}", fontsize=9)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
    if stopped:
        print(stopped_note(stopped))
        return STOPPED_STATUS
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
