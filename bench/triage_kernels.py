"""Which NYSTROM_TRITON=all kernel faults on this GPU? Each case (one kernel or the whole layer, forward and
backward, at one shape) runs in its own process — an illegal memory access kills the CUDA context, and without
CUDA_LAUNCH_BLOCKING the error surfaces at some later, innocent kernel. With --sanitize N, the first N failing
cases are run again under compute-sanitizer's memcheck, which names the kernel and the bad address.

    python bench/triage_kernels.py [--sanitize N]        # the table of cases
    python bench/triage_kernels.py --case lk:bf16:16:1000  # one case, in this process (CPU: TRITON_INTERPRET=1)
    python bench/triage_kernels.py --cases lq:fp32:64:1000:BLOCK_K=32,num_warps=4  # pass 1 backward variants

Every case prints the output's and gradients' relative errors against an fp64 reference (SDPA, or the PyTorch
path). A case may end in overrides: of pass 1's backward launch constants ("lq"), or of the core's warps
("core:bf16:16:1000:num_warps=4"); the other kinds take none (refused).

The table needs a CUDA GPU; on the CPU it runs only under TRITON_INTERPRET=1 (the kernels interpreted: give
--cases of small n, the default table's take minutes a case). A case that does not finish within --timeout
seconds is killed and its row says "timed out"; like a case that fails, it makes the exit status 1, and the rows
of the others are still measured. A compute-sanitizer run that cannot start or passes --sanitize-timeout is said
so, and the next one runs. Stopped (SIGTERM from a time limit, or Ctrl-C), the script kills its cases, keeps the
rows printed and exits 130 (bench/time_limit.py).
"""
import argparse
import concurrent.futures
import os
import subprocess
import sys
import threading

import torch

from time_limit import STOPPED_STATUS, stop_on_sigterm, stopped_note

KINDS = ("lq", "lk", "core", "layer-unfused", "layer-fused")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# What a case's overrides may set: pass 1's backward launch constants (lq), the core's warps (core)
OVERRIDES = {"lq": ("BLOCK_M", "BLOCK_K", "BLOCK_D", "PREC", "IS_F64", "tiles", "num_warps", "num_stages"),
             "core": ("num_warps",)}


def parse_case(spec: str) -> tuple[str, torch.dtype, int, int, dict]:
    """KIND:DTYPE:HEAD_DIM:N[:KEY=VALUE,...] as (kind, dtype, d, n, overrides); ValueError saying what is wrong."""
    parts = spec.split(":")
    if len(parts) not in (4, 5):
        raise ValueError("not KIND:DTYPE:HEAD_DIM:N[:KEY=VALUE,...]")
    kind, dtype_name, d, n, *override = parts
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    if not (d.isdigit() and n.isdigit() and int(d) > 0 and int(n) > 0):
        raise ValueError(f"head_dim {d!r} and n {n!r} must be positive integers")
    extra = {}
    for item in override[0].split(",") if override else []:
        key, sep, val = item.partition("=")
        if key not in OVERRIDES.get(kind, ()):
            raise ValueError(f"{kind} takes no override {key!r}" + (
                f" (it takes {', '.join(OVERRIDES[kind])})" if kind in OVERRIDES else
                " (overrides are of lq's backward launch constants and core's num_warps only)"))
        if not sep or not (key == "PREC" or val.lstrip("-").isdigit()):
            raise ValueError(f"override {item!r} is not {key}={'NAME' if key == 'PREC' else 'INTEGER'}")
        extra[key] = val if key == "PREC" else int(val)
    return kind, DTYPES[dtype_name], int(d), int(n), extra


def run_case(spec: str) -> None:
    from nystromformer.attention import nystrom_fast, nystrom_triton as nt
    kind, dtype, d, n, extra = parse_case(spec)
    if kind == "lq" and extra:  # pass 1: its backward's launch constants
        plain = nt._lq_consts
        nt._lq_consts = lambda q_land, backward: {**plain(q_land, backward), **(extra if backward else {})}
    if kind == "core" and extra:  # the core: its warps
        nt._core_warps = lambda m, d: extra["num_warps"]
    b, h, m = 4, 3, 64
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: under TRITON_INTERPRET=1, to try the script
    torch.manual_seed(0)
    keep = torch.ones(b, n, device=dev, dtype=torch.float64)
    for row, pad in enumerate((0, n * 137 // 1000, n * 2 // 5, 0)):  # n = 1000: 137 and 400 padded keys
        if pad:
            keep[row, n - pad:] = 0
    sdpa = torch.nn.functional.scaled_dot_product_attention
    lm = (b, h, m, d)
    if kind == "lq":
        shapes = [lm, (b, h, n, d), (b, h, n, d)]
        bias = lambda t: (1 - keep.to(t.dtype)) * torch.finfo(t.dtype).min  # noqa: E731
        fast = lambda ql, k, v: nt.landmark_queries_attention(ql, k, v, bias(ql))  # noqa: E731
        ref = lambda ql, k, v: sdpa(ql, k, v, attn_mask=bias(ql)[:, None, None, :])  # noqa: E731
    elif kind == "lk":
        shapes = [(b, h, n, d), lm, lm]
        fast = lambda q, kl, zw: nt.landmark_keys_attention(q, keep.to(q.dtype), kl, zw)  # noqa: E731
        ref = lambda q, kl, zw: sdpa(q * keep[:, None, :, None], kl, zw)  # noqa: E731
    elif kind == "core":
        shapes = [lm, lm, lm]
        prec = "tf32" if dtype != torch.float32 else "tf32x3"
        fast = lambda ql, kl, w: nt.landmark_core(ql, kl, w, 6, prec)  # noqa: E731
        ref = lambda ql, kl, w: nystrom_fast.landmark_middle(ql, kl, w, 6, "original", False, "ieee")  # noqa: E731
    else:
        shapes = [(b, h, n, d)] * 3 + [(h, 1, 33, 1)]

        def layer(q, k, v, w, triton=True):
            return nystrom_fast.forward(q, k, v, keep.to(q.dtype), num_landmarks=m, conv_weight=w.float() if triton
                                        else w, use_triton=triton, fused_backward=triton and kind == "layer-fused")
        fast, ref = layer, lambda *t: layer(*t, triton=False)
    leaves64 = [torch.randn(s, device=dev, dtype=torch.float64) for s in shapes]
    leaves = [t.to(dtype).requires_grad_() for t in leaves64]
    leaves64 = [t.requires_grad_() for t in leaves64]
    out = fast(*leaves)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    g = torch.randn_like(out, dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, g.to(out.dtype))
    sync()
    out64 = ref(*leaves64)
    grads64 = torch.autograd.grad(out64, leaves64, g)
    errs = [((a.double() - r).norm() / r.norm()).item() for a, r in zip([out, *grads], [out64, *grads64])]
    print(f"rel. errors vs fp64 reference (out, grads): {', '.join(f'{e:.1e}' for e in errs)}")


def run_process(command: list[str], env: dict, timeout: float, running: set, stopping: threading.Event):
    """(exit status, stdout, stderr) of ``command``; the status is "timed out" when it ran past ``timeout``
    seconds (killed; what it printed is kept), or "could not start: …"."""
    if stopping.is_set():
        return "stopped", "", ""
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as error:
        return f"could not start: {type(error).__name__}: {error}", "", ""
    with proc:
        running.add(proc)
        if stopping.is_set():  # started as the script was stopped
            proc.kill()
        try:
            out, err = proc.communicate(timeout=timeout)
            return proc.returncode, out, err
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return "timed out", out, err
        finally:
            running.discard(proc)


def outcome(status, out: str, err: str, timeout: float) -> str:
    """A case's cell: ok and its errors, or why it failed."""
    if status == 0:
        return "ok " + out.strip().replace("\n", "; ")
    if status == "timed out":
        return f"timed out after {timeout:g} s"
    if isinstance(status, str):
        return status
    lines = [x for x in err.splitlines() if "Error" in x or "error" in x]
    return lines[-1] if lines else f"exit status {status}"


def validate_args(ap, args) -> None:
    """Each case parses, and the limits are positive (also what a dry run checks before device time)."""
    for flag, specs in (("--case", args.case), ("--cases", args.cases)):
        for spec in specs or []:
            try:
                parse_case(spec)
            except ValueError as error:
                ap.error(f"{flag} {spec}: {error}")
    if args.sanitize < 0:
        ap.error(f"--sanitize must be at least 0 (failing cases to run again), got {args.sanitize}")
    for flag, value in (("--timeout", args.timeout), ("--sanitize-timeout", args.sanitize_timeout)):
        if not value > 0:
            ap.error(f"{flag} must be positive (seconds before a process is killed), got {value:g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", nargs="+", help="run these cases in this process (one line each)")
    p.add_argument("--cases", nargs="+", help="these cases instead of the table's")
    p.add_argument("--sanitize", type=int, default=0, metavar="N",
                   help="run the first N failing cases again under compute-sanitizer memcheck")
    p.add_argument("--timeout", type=float, default=300, metavar="S",
                   help="seconds before a case's process is killed and its row says timed out (default %(default)g)")
    p.add_argument("--sanitize-timeout", type=float, default=150, metavar="S",
                   help="seconds before a compute-sanitizer run is killed (default %(default)g)")
    args = p.parse_args()
    validate_args(p, args)
    if args.case:
        os.environ["NYSTROM_TRITON"] = "all"  # the kernels this script is for ("layer-fused" needs it)
        from nystromformer.attention import nystrom_triton as nt
        plain = nt._lq_consts, nt._core_warps
        for spec in args.case:
            try:
                run_case(spec)
            finally:  # a case's overrides end with it
                nt._lq_consts, nt._core_warps = plain
        return
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = "CPU, Triton interpreted (TRITON_INTERPRET=1)"
    else:
        p.error("the table runs each case on a CUDA GPU, and none is available here; on the CPU, set "
                "TRITON_INTERPRET=1 (the kernels interpreted: give --cases of small n) or run one case with --case")
    stop_on_sigterm()
    env = dict(os.environ, NYSTROM_TRITON="all", CUDA_LAUNCH_BLOCKING="1")
    print(f"# NYSTROM_TRITON=all kernels, one process per case (b=4, h=3, m=64, padding), {device}\n"
          f"| case | result |\n|---|---|", flush=True)
    specs = args.cases or [f"{kind}:{dtype}:{d}:{n}" for kind in KINDS for dtype in ("bf16", "fp32")
                           for d in (16, 64) for n in (1000, 512)]
    running, stopping = set(), threading.Event()

    def one(spec):  # four at a time: each process spends most of its time importing and compiling
        return run_process([sys.executable, __file__, "--case", spec], env, args.timeout, running, stopping)

    failing, where = [], "the table of cases"
    pool = concurrent.futures.ThreadPoolExecutor(4)
    try:
        for spec, (status, out, err) in zip(specs, pool.map(one, specs)):
            print(f"| {spec} | {outcome(status, out, err, args.timeout)} |", flush=True)
            if status != 0:
                failing.append(spec)
        pool.shutdown()
        for spec in failing[:args.sanitize]:
            where = f"compute-sanitizer's run of {spec}"
            print(f"\n# compute-sanitizer memcheck, {spec} (host frames left out)", flush=True)
            status, out, err = run_process(["compute-sanitizer", "--tool", "memcheck", "--print-limit", "4",
                                            sys.executable, __file__, "--case", spec],
                                           dict(env, CUDA_LAUNCH_BLOCKING="0"), args.sanitize_timeout, running,
                                           stopping)
            print("\n".join([x for x in (out + err).splitlines() if "Host Frame" not in x][:60]), flush=True)
            if isinstance(status, str):
                print(f"# compute-sanitizer {outcome(status, out, err, args.sanitize_timeout)}"
                      + (" (is the CUDA toolkit's bin folder on PATH?)" if status.startswith("could not") else ""),
                      flush=True)
    except KeyboardInterrupt:
        stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(running):
            proc.kill()
        print(stopped_note(where), flush=True)
        sys.exit(STOPPED_STATUS)
    if failing:
        print(f"\n{len(failing)} of {len(specs)} cases failed or timed out: {' '.join(failing)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
