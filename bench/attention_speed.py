"""Attention core, forward + backward: time, peak memory and ratios for every implementation, in one run.

Issue #6's setting: a fixed number of tokens per batch (default 65,536, batch = tokens / n), 12 heads, head dim 64,
64 landmarks, conv kernel 33, a key padding mask (all ones unless --pad), q/k/v as the model makes them
((b, n, h, d) transposed to (b, h, n, d) views). Implementations:

  sdpa           F.scaled_dot_product_attention, bf16 (exact softmax; FlashAttention on CUDA), no mask
  paper-fp32     nystrom.reference_forward in fp32 with the reference's Conv2d (the authors' code)
  fast-torch     nystrom_fast.forward, bf16, PyTorch ops only (grouped conv1d, batched pinv)
  fast-triton    nystrom_fast.forward, bf16, Triton kernels for segment means, pinv and conv+add
  fast-triton-fp32  as above in fp32 (what the model runs with attention_fp32: true)
  fast-triton-all[-fp32]  NYSTROM_TRITON=all: also the Triton kernels for both attention passes and the one-node
                 training backward (built after the first H100 measurements)
  fast-triton[-all]-overlap  the same with NYSTROM_OVERLAP=1: kernel_2 and the pseudo-inverse on a second CUDA
                 stream beside pass 1, forward and backward
  fast-triton-all-conv-apart  (only when named in --impls) fast-triton-all with the conv added by its own kernel
                 after pass 2, as timed on 2026-11-23, instead of inside pass 2's forward
  fast-triton-all-conv-bwd-apart  (only when named in --impls) fast-triton-all with the conv's input and weight
                 gradients from two kernels, as timed on 2026-11-23, instead of one pass (bf16)
  fast-triton-all-recompute  (only when named in --impls) fast-triton-all with NYSTROM_RECOMPUTE=1: the backward
                 recomputes the landmark-sized tensors instead of reading them (memory for time)

Time: CUDA events, warm-up, median of --repeat runs of forward+backward (the gradient w.r.t. q, k, v and the conv
weight), L2 flushed between runs; CPU: perf_counter. Memory: torch.cuda.max_memory_allocated above what was
allocated before the pass (inputs excluded). "x floor": time over issue #6's bandwidth floor — reading q, k, v,
o, dO and writing o, dq, dk, dv once: 9 tensors of tokens·h·d elements — over the device-to-device copy bandwidth
measured at start (in the CSV: `floor_tensors`, `bandwidth_gbs`; tables before 2026-11-29 counted 12, q, k and v
read again by the backward, so their "x floor" is 3/4 of the issue's). "err": relative error of the
output against the fp32 reference on the first batch element (--check). --graphs (CUDA): the same forward+backward
also captured once as a CUDA graph and replayed (median of --repeat, L2 flushed), so no host time sits between
its launches — the kernels' own time, and what training gets with `gpu_setting.compile: reduce-overhead`; its
ratios are to SDPA's graph and to the floor. A capture that fails is named under the table. "host ms" (CUDA): the
median time the host takes to issue one forward+backward while the device is still busy with a sleep queued before
it — so no launch waits for the device, and the figure is the host's own work (Python, autograd, dispatch, the
launchers). Next to "ms" it says which side bounds the eager time: host ms near ms means the device waited for
the host. A host that had to wait for the device (a synchronization inside the pass) shows as at least the
sleep's length, and is named under the table.

    python bench/attention_speed.py                          # CUDA, issue #6's lengths, one table
    python bench/attention_speed.py --csv out.csv --plot docs/img/attention_speed.png --check
    python bench/attention_speed.py --graphs --impls sdpa fast-triton-all   # eager and CUDA-graph times
    python bench/attention_speed.py --device cpu --tokens 4096 --lengths 256 1024 --repeat 3   # smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))
from nystromformer.attention import build_attention, nystrom_fast  # noqa: E402
from nystromformer.config import ModelConfig  # noqa: E402

from compile_first import print_commands, run_untimed, workers_for  # noqa: E402
from time_limit import STOPPED_STATUS, failure, stop_on_sigterm, stopped_note  # noqa: E402

IMPLS = ["sdpa", "paper-fp32", "fast-torch", "fast-triton", "fast-triton-fp32", "fast-triton-all",
         "fast-triton-all-fp32", "fast-triton-overlap", "fast-triton-all-overlap"]
# Not run by default: for comparisons of one change (--impls ... fast-triton-all-conv-apart)
EXTRA_IMPLS = ["fast-triton-all-conv-apart", "fast-triton-all-conv-bwd-apart", "fast-triton-all-recompute"]
# The least device sleep queued before the host timing: well above any pass's host time seen so far (~5 ms)
HOST_BUSY_MS = 25.0
# issue #6's bandwidth floor: read q, k, v, o, dO and write o, dq, dk, dv once (tokens·h·d elements each)
FLOOR_TENSORS = 9


def with_env(env, fn):
    """fn with the environment variables ``env`` set during the forward call (the backward follows the forward's
    choices: NYSTROM_TRITON's kernels, NYSTROM_OVERLAP's streams)."""
    def run(*args):
        old = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            return fn(*args)
        finally:
            for key, value in old.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value
    return run


@contextlib.contextmanager
def module_switches(name):
    """The implementation's nystrom_triton switches, held while it runs forward *and* backward (the backward reads
    some of them, e.g. CONV_BACKWARD_ONE_PASS_MAX_BYTES), then restored."""
    switches = {}
    if name.endswith("-conv-apart"):  # the conv added by its own kernel after pass 2, as before it was fused
        switches["CONV_IN_PASS_2"] = False
    if name.endswith("-conv-bwd-apart"):  # the conv's two gradients by two kernels, as before the one pass
        switches["CONV_BACKWARD_ONE_PASS_MAX_BYTES"] = 0
    if not switches:
        yield
        return
    from nystromformer.attention import nystrom_triton  # imported when used, as nystrom_fast does
    old = {key: getattr(nystrom_triton, key) for key in switches}
    for key, value in switches.items():
        setattr(nystrom_triton, key, value)
    try:
        yield
    finally:
        for key, value in old.items():
            setattr(nystrom_triton, key, value)


def make_impl(name, layer):
    w = None if layer.conv is None else layer.conv.weight
    kw = dict(num_landmarks=layer.num_landmarks, pinv_iterations=layer.pinv_iterations, init=layer.init_option,
              conv_weight=w)
    if name == "sdpa":
        return torch.bfloat16, lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v)
    if name == "paper-fp32":
        return torch.float32, layer.reference_forward
    if name == "fast-torch":
        return torch.bfloat16, lambda q, k, v, mask: nystrom_fast.forward(q, k, v, mask, use_triton=False, **kw)
    if name.startswith("fast-triton"):
        env = {"NYSTROM_TRITON": "all" if "-all" in name else "1",
               "NYSTROM_OVERLAP": "1" if name.endswith("-overlap") else "0",
               "NYSTROM_RECOMPUTE": "1" if name.endswith("-recompute") else "0"}
        fn = with_env(env, lambda q, k, v, mask: nystrom_fast.forward(q, k, v, mask, use_triton=True, **kw))
        return (torch.float32 if name.endswith("fp32") else torch.bfloat16), fn
    raise ValueError(name)


def inputs(b, n, h, d, dtype, device, pad, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = [torch.randn(b, n, h, d, generator=g).to(device, dtype).transpose(1, 2).requires_grad_()
           for _ in range(3)]
    mask = torch.ones(b, n, device=device)
    if pad:
        mask[: (b + 1) // 2, n - int(n * pad):] = 0  # half the rows padded by the fraction `pad`
    return qkv, mask


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_bandwidth(device):
    if device.type != "cuda":
        return None
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); y.copy_(x); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * x.numel() / statistics.median(times)  # bytes read + written per second


def time_once(fn, args, grad, params, device, flush):
    if device.type == "cuda":
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = fn(*args)
        torch.autograd.grad(out, params, grad)
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e)
    t = time.perf_counter()
    out = fn(*args)
    torch.autograd.grad(out, params, grad)
    return (time.perf_counter() - t) * 1e3


def run(name, layer, b, n, args, device, flush):
    with module_switches(name):
        return run_with_switches(name, layer, b, n, args, device, flush)


def run_with_switches(name, layer, b, n, args, device, flush):
    dtype, fn = make_impl(name, layer)
    (q, k, v), mask = inputs(b, n, args.heads, args.head_dim, dtype, device, args.pad)
    params = [q, k, v] + ([layer.conv.weight] if layer.conv is not None and name != "sdpa" else [])
    out = fn(q, k, v, mask)
    grad = torch.randn_like(out)
    del out
    for _ in range(args.warmup):
        time_once(fn, (q, k, v, mask), grad, params, device, flush)
    sync(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        time_once(fn, (q, k, v, mask), grad, params, device, flush)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    times = [time_once(fn, (q, k, v, mask), grad, params, device, flush) for _ in range(args.repeat)]
    host = None
    if device.type == "cuda":
        busy_ms = max(HOST_BUSY_MS, 4 * statistics.median(times))
        # half the repeats (at least 3): each one waits out its sleep, and the column only has to tell host from device
        host = time_host(fn, (q, k, v, mask), grad, params, max(3, args.repeat // 2), busy_ms)
    graphed = None
    if args.graphs and device.type == "cuda":
        graphed = time_graphed(fn, (q, k, v, mask), grad, params, flush, args.repeat)
    err = None
    if args.check and name != "sdpa":
        with torch.no_grad():
            q1, k1, v1 = (t[:1].float() for t in (q, k, v))
            ref = layer.reference_forward(q1, k1, v1, mask[:1])
            err = ((fn(q[:1], k[:1], v[:1], mask[:1]).float() - ref).norm() / ref.norm()).item()
    return statistics.median(times), peak, err, graphed, host


_CYCLES_PER_MS = []


def sleep_cycles(ms):
    """GPU clock cycles for torch.cuda._sleep to keep the device busy for about ``ms`` (calibrated once)."""
    if not _CYCLES_PER_MS:
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)  # untimed first: an idle GPU raises its clock as it goes
        s.record(); torch.cuda._sleep(10_000_000); e.record(); torch.cuda.synchronize()
        _CYCLES_PER_MS.append(10_000_000 / s.elapsed_time(e))
    return int(ms * _CYCLES_PER_MS[0])


def time_host(fn, args, grad, params, repeat, busy_ms):
    """(median ms the host takes to issue one forward+backward behind about ``busy_ms`` of queued device sleep,
    median ms the sleep took, timed by CUDA events): the host's own time per pass, with no launch waiting for the
    device. A pass that synchronizes waits out the sleep, so a first figure near the second or above it means the
    host waited for the device (the second measured, not assumed: the clock the sleep counts can change)."""
    cycles, times, slept = sleep_cycles(busy_ms), [], []
    for _ in range(repeat):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record(); torch.cuda._sleep(cycles); e.record()
        t = time.perf_counter()
        torch.autograd.grad(fn(*args), params, grad)
        times.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        slept.append(s.elapsed_time(e))
    return statistics.median(times), statistics.median(slept)


def time_graphed(fn, args, grad, params, flush, repeat):
    """Median ms of one forward+backward captured as a CUDA graph and replayed: the launches' device time with no
    host work between them (what `gpu_setting.compile: reduce-overhead` gives training), or the capture's error."""
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream before capturing, as torch.cuda.graph asks
            for _ in range(2):
                torch.autograd.grad(fn(*args), params, grad)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            torch.autograd.grad(fn(*args), params, grad)
        times = []
        for _ in range(repeat):
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)
    except Exception as exc:  # a capture that fails is a note under the table, not the end of the run
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
    finally:
        del graph
        torch.cuda.empty_cache()


def kernel_breakdown(name, layer, b, n, args, device, rows=14):
    """torch.profiler's table of the kernels in one forward+backward (after a warm-up), by self device time."""
    from torch.profiler import ProfilerActivity, profile
    dtype, fn = make_impl(name, layer)
    (q, k, v), mask = inputs(b, n, args.heads, args.head_dim, dtype, device, args.pad)
    params = [q, k, v] + ([layer.conv.weight] if layer.conv is not None and name != "sdpa" else [])
    with module_switches(name):
        grad = torch.randn_like(fn(q, k, v, mask))
        for _ in range(2):
            torch.autograd.grad(fn(q, k, v, mask), params, grad)
        sync(device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            torch.autograd.grad(fn(q, k, v, mask), params, grad)
            sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def untimed_argv(args, name: str) -> list[str]:
    """This script for one implementation at every length, once, untimed: it launches what the table's rows of
    that implementation launch (the same shapes, and --check's no-grad forward), so it compiles their kernels."""
    check = ["--check"] if args.check else []
    return [sys.executable, __file__, "--device", args.device, "--tokens", str(args.tokens), "--lengths",
            *map(str, args.lengths), "--impls", name, "--heads", str(args.heads), "--head-dim", str(args.head_dim),
            "--landmarks", str(args.landmarks), "--conv", str(args.conv), "--init", args.init, "--pad",
            str(args.pad), "--warmup", "0", "--repeat", "1", "--compile-workers", "0", *check]


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    stop_on_sigterm()
    device = torch.device(args.device)
    if args.graphs and device.type != "cuda":
        ap.error("--graphs needs a CUDA device (CUDA graphs)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        args.impls = [i for i in args.impls if "triton" not in i]  # Triton needs CUDA (or its interpreter)
    workers = workers_for(args.compile_workers, device.type)
    compiled = [name for name in dict.fromkeys(args.impls + (args.kernels or [])) if "triton" in name]
    untimed = [untimed_argv(args, name) for name in compiled]  # one an implementation: its lengths share kernels
    if args.print_untimed:
        print_commands(untimed)
        return
    if workers > 0 and compiled:
        print(run_untimed(untimed, dict(os.environ), workers), flush=True)
    stopped, failures = run_table(args, device)
    if stopped:
        sys.exit(STOPPED_STATUS)
    if failures:
        sys.exit(1)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 16384, 65536])
    ap.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS + EXTRA_IMPLS)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--landmarks", type=int, default=64)
    ap.add_argument("--conv", type=int, default=33)
    ap.add_argument("--init", default="original", choices=["original", "exact"])
    ap.add_argument("--pad", type=float, default=0.0, help="fraction of padding in half the rows")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--check", action="store_true", help="also report relative error vs the fp32 reference")
    ap.add_argument("--graphs", action="store_true",
                    help="CUDA: also time each forward+backward replayed as one CUDA graph (no host time between "
                         "launches), with its ratios to SDPA's graph and to the floor")
    ap.add_argument("--kernels", nargs="*", metavar="IMPL", choices=IMPLS + EXTRA_IMPLS,
                    help="after the table, a per-kernel CUDA time breakdown (torch.profiler) of one fwd+bwd of "
                         "these implementations at each length")
    ap.add_argument("--compile-workers", type=int, default=None, metavar="N",
                    help="first run each Triton implementation (of --impls and --kernels) once at every length, "
                         "untimed, in a process of its own, N at a time, so the table's runs load the kernels from "
                         "Triton's cache instead of compiling them one at a time (default 8 on CUDA; 0 on the CPU: "
                         "the interpreter compiles nothing)")
    ap.add_argument("--print-untimed", action="store_true",
                    help="print the untimed compile pass's commands (JSON, one a line) and stop: "
                         "`compile_first.py` runs several benchmarks' in one pool (gpu_session.sh's targets stage)")
    ap.add_argument("--csv")
    ap.add_argument("--plot")
    return ap


def run_table(args, device: torch.device) -> tuple[bool, list[str]]:
    """Prints the table (and writes --csv, --plot) of the rows measured; (stopped early, failed rows)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig(num_head=args.heads, head_dim=args.head_dim, transformer_dim=args.heads * args.head_dim,
                      num_landmarks=args.landmarks, conv_kernel_size=args.conv or None, inv_coeff_init_option=args.init)
    torch.manual_seed(0)
    layer = build_attention(cfg).to(device)
    bandwidth = measure_bandwidth(device)
    flush = torch.empty(64 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    rows, graph_errors, host_waits, failures, stopped = [], [], [], [], None
    measuring = ["the setup"]
    try:
        measure_rows(args, device, layer, bandwidth, flush, rows, graph_errors, host_waits, failures, measuring)
    except KeyboardInterrupt:
        stopped = measuring[0]
    print_table(args, device, bandwidth, rows, graph_errors, host_waits, failures)
    if stopped:
        print(stopped_note(stopped))
    elif args.kernels:
        try:
            for name in args.kernels:
                for n in args.lengths:
                    print(f"\n# kernels of {name}, n={n}, batch={max(1, args.tokens // n)} (one fwd+bwd, self CUDA "
                          "time)")
                    print(kernel_breakdown(name, layer, max(1, args.tokens // n), n, args, device))
        except KeyboardInterrupt:
            stopped = "the kernel breakdowns"
            print(stopped_note(stopped))
    if rows:
        write_csv_and_plot(args, device, rows)
    return bool(stopped), failures


def measure_rows(args, device, layer, bandwidth, flush, rows, graph_errors, host_waits, failures,
                 measuring) -> None:
    """Appends a row per (length, implementation) to ``rows`` as it is measured, so a stop keeps them;
    ``measuring[0]`` names the row under way."""
    for n in args.lengths:
        b = max(1, args.tokens // n)
        sdpa_ms = sdpa_graph_ms = None
        for name in args.impls:
            measuring[0] = f"{name} at n = {n}"
            try:
                ms, peak, err, graphed, host = run(name, layer, b, n, args, device, flush)
            except torch.OutOfMemoryError:
                ms = peak = err = graphed = host = None
                torch.cuda.empty_cache()
            except Exception as error:  # noqa: BLE001 — named under the table; the other rows still measured
                failures.append(failure(f"{name} at n = {n}", error))
                ms = peak = err = graphed = host = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            host_ms = None
            if host is not None:
                host_ms, slept_ms = host
                if host_ms >= 0.9 * slept_ms:
                    host_waits.append(f"{name} at n = {n}: {host_ms:.1f} ms behind {slept_ms:.1f} ms of device sleep")
            if isinstance(graphed, str):
                graph_errors.append(f"{name} at n = {n}: {graphed}")
                graphed = None
            if name == "sdpa":
                sdpa_ms, sdpa_graph_ms = ms, graphed
            elem = 4 if name in ("paper-fp32",) or name.endswith("fp32") else 2
            floor_ms = (FLOOR_TENSORS * b * n * args.heads * args.head_dim * elem / bandwidth * 1e3 if bandwidth
                        else None)
            row = dict(n=n, batch=b, impl=name, ms=ms, host_ms=host_ms, peak_mib=peak,
                       vs_sdpa=(ms / sdpa_ms if ms and sdpa_ms else None),
                       x_floor=(ms / floor_ms if ms and floor_ms else None), rel_err=err,
                       floor_tensors=FLOOR_TENSORS, bandwidth_gbs=(bandwidth / 1e9 if bandwidth else None))
            if args.graphs:
                row.update(graph_ms=graphed, graph_vs_sdpa=(graphed / sdpa_graph_ms if graphed and sdpa_graph_ms
                                                            else None),
                           graph_x_floor=(graphed / floor_ms if graphed and floor_ms else None))
            rows.append(row)


def print_table(args, device, bandwidth, rows, graph_errors, host_waits, failures) -> None:
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# attention fwd+bwd, {args.tokens} tokens/batch, h={args.heads}, d={args.head_dim}, m={args.landmarks}, "
          f"conv={args.conv}, pad={args.pad}, device={dev}, torch {torch.__version__}"
          + (f", copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""))
    fmt = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
    graph_head = " graph ms | × SDPA's graph | × floor (graph) |" if args.graphs else ""
    print(f"| n | batch | impl | ms | host ms | × SDPA | × floor ({FLOOR_TENSORS} tensors) | peak MiB | rel err |"
          + graph_head)
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * graph_head.count("|"))
    for r in rows:
        graph_cells = (f" {fmt(r['graph_ms'], '.3f')} | {fmt(r['graph_vs_sdpa'], '.3f')} | "
                       f"{fmt(r['graph_x_floor'], '.1f')} |" if args.graphs else "")
        print(f"| {r['n']} | {r['batch']} | {r['impl']} | {fmt(r['ms'], '.3f')} | {fmt(r['host_ms'], '.3f')} | "
              f"{fmt(r['vs_sdpa'], '.3f')} | "
              f"{fmt(r['x_floor'], '.1f')} | {fmt(r['peak_mib'], '.0f')} | {fmt(r['rel_err'], '.1e')} |" + graph_cells)
    for note in graph_errors:
        print(f"\nCUDA graph not captured: {note}")
    for note in host_waits:
        print(f"\nThe host waited for the device (a synchronization inside forward+backward): {note}")
    for note in failures:
        print(f"\nFailed (its row is n/a): {note}")
    sys.stdout.flush()


def write_csv_and_plot(args, device, rows) -> None:
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.csv:  # with the device on every row (bench/targets_report.py names it)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*rows[0], "device"])
            w.writeheader()
            w.writerows(dict(r, device=dev) for r in rows)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for name in args.impls:
            pts = [r for r in rows if r["impl"] == name and r["ms"] is not None]
            ax1.plot([r["n"] for r in pts], [r["ms"] for r in pts], "o-", label=name)
            if any(r["peak_mib"] is not None for r in pts):
                ax2.plot([r["n"] for r in pts], [r["peak_mib"] for r in pts], "o-", label=name)
        for ax, lab in ((ax1, "fwd+bwd ms"), (ax2, "peak MiB")):
            ax.set_xscale("log", base=2); ax.set_yscale("log"); ax.set_xlabel("n"); ax.set_ylabel(lab)
        ax1.legend(fontsize=8)
        fig.suptitle(f"attention, {args.tokens} tokens/batch, {dev}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
