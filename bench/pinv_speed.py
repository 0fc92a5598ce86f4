"""The pseudo-inverse iteration alone: Triton kernel variants (precision × warps) vs the batched PyTorch iteration.

For each number of matrices (batch × heads: 1,536 = n 512 at 65,536 tokens and 12 heads; 192 = n 4096; 12 = one
n 65,536 sequence) it times the forward and forward+backward of 6 iterations on m × m softmax matrices and reports
the relative error of the output and of the gradient against float64. One table, one run.

A second table times the whole landmark middle, pinv(softmax(Q̃K̃ᵀ/√d)) @ W from bf16 landmarks (what sits between
the two attention passes): PyTorch ops around the pinv kernel (``NYSTROM_TRITON=1``) against the fused
``landmark_core`` kernels (``=all``) — with the backward replaying the forward and with the forward keeping its
iterates (``CORE_KEEP_MAX``), and split as ``NYSTROM_OVERLAP=1`` runs it — with the launches each makes. Both tables
also time the iteration's backward in its transposed form (``PINV_BACKWARD_TRANSPOSED``: less shared memory, so
two programs per SM).

    python bench/pinv_speed.py                    # CUDA
    python bench/pinv_speed.py --matrices 1536 --m 64 --precisions tf32 --warps 8,8
    python bench/pinv_speed.py --middle-only        # just the second table

"fwd ms" times the forward as training runs it (inputs that require grad, the graph built and dropped): the
"iterates kept" rows keep them only then. A row that fails is `failed` in the table and named under it (exit
status 1); stopped by SIGTERM (gpu_session.sh's time limit) the rows so far stand, with a note (exit 130).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))
from nystromformer.attention import nystrom_fast, nystrom_triton  # noqa: E402
from nystromformer.attention.nystrom import iterative_pinv, pinv_init  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_limit import STOPPED_STATUS, failure, stop_on_sigterm, stopped_note  # noqa: E402


REPEAT = 20


def bench(fn):
    """Median ms of fn over REPEAT calls after 3 warm-up calls: CUDA events on a GPU; on the CPU (a smoke run
    under Triton's interpreter, figures meaningless) wall time."""
    if not torch.cuda.is_available():
        fn()
        times = []
        for _ in range(REPEAT):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEAT):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def warps_pair(text: str) -> str:
    """--warps' FORWARD,BACKWARD: two powers of two (Triton's num_warps)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 and int(p) & (int(p) - 1) == 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected FORWARD,BACKWARD warps, powers of two, e.g. 4,8")
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrices", type=int, nargs="+", default=[1536, 192, 12])
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--precisions", nargs="+", default=["ieee", "tf32x3", "tf32"], choices=["ieee", "tf32x3", "tf32"],
                    help="Triton's input_precision for the iteration's products")
    ap.add_argument("--warps", nargs="+", default=["4,4", "4,8", "8,8", "8,16", "8,4"], type=warps_pair,
                    help="forward,backward warps per program")
    ap.add_argument("--backward-forms", nargs="+", default=["direct", "transposed"],
                    choices=["direct", "transposed"], help="the iteration's backward (PINV_BACKWARD_TRANSPOSED)")
    ap.add_argument("--middle-only", action="store_true",
                    help="only the landmark-middle table (whose rows are fixed: --precisions, --warps and "
                         "--backward-forms are the first table's)")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="timed calls per row (median)")
    args = ap.parse_args(argv)
    validate_args(ap, args)
    globals()["REPEAT"] = args.repeat
    # Without CUDA: a smoke run (TRITON_INTERPRET=1, tiny --matrices / --m) that checks the script, not speed.
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stop_on_sigterm()
    failures, where = [], ["the first row"]
    try:
        if not args.middle_only:
            pinv_table(args, dev, failures, where)
        middle_table(args, dev, failures, where)
    except KeyboardInterrupt:
        print(stopped_note(where[0]))
        sys.exit(STOPPED_STATUS)
    if failures:
        print("\nFailed rows:")
        for line in failures:
            print(f"- {line}")
        sys.exit(1)


def validate_args(ap, args):
    """Sizes checked by flag before any row (also by `DRY_RUN=1 bash bench/gpu_session.sh`): a repeat of 0 failed
    every row on an empty median, and m above the kernels' limit silently timed the PyTorch fallback."""
    if args.repeat < 1:
        ap.error(f"--repeat: must be at least 1, got {args.repeat}")
    if not 1 <= args.m <= nystrom_fast.MAX_LANDMARKS:
        ap.error(f"--m: the kernels take 1 to {nystrom_fast.MAX_LANDMARKS} landmarks (above, the layer runs "
                 f"PyTorch ops instead), got {args.m}")
    if args.iters < 0:
        ap.error(f"--iters: must be at least 0, got {args.iters}")
    bad = [m for m in args.matrices if m < 1]
    if bad:
        ap.error(f"--matrices: each must be at least 1, got {bad[0]}")


def rel(x, y):
    return ((x.double() - y).norm() / y.norm()).item()


def middle_table(args, dev, failures, where, d=64):
    torch.backends.cuda.matmul.allow_tf32 = False  # as the model runs (pinv_table may have left it on)
    print(f"\n# landmark middle pinv(softmax(Q̃K̃ᵀ/√d)) @ W, bf16 landmarks (m={args.m}, d={d}, {args.iters} steps, "
          "pinv at tf32), fwd / fwd+bwd ms, errors vs float64")
    print("| matrices | impl | launches fwd+bwd | fwd ms | fwd+bwd ms | out err | grad err (Q̃, K̃, W) |")
    print("|---|---|---|---|---|---|---|")
    for bsz in args.matrices:
        g = torch.Generator(device="cpu").manual_seed(bsz)
        x64 = [torch.randn(bsz, 1, args.m, d, generator=g, dtype=torch.float64).to(dev).requires_grad_()
               for _ in range(3)]
        gout = torch.randn(bsz, 1, args.m, d, generator=g, dtype=torch.float64).to(dev)
        ref = nystrom_fast.landmark_middle(*x64, args.iters, "original", False, "ieee")
        ref_grads = torch.autograd.grad(ref, x64, gout)
        xs = [t.detach().bfloat16().requires_grad_() for t in x64]
        for name, core, keep_max, split, transposed, core_warps in MIDDLES:
            settings = (nystrom_triton.CORE_KEEP_MAX, nystrom_triton.PINV_BACKWARD_TRANSPOSED, nystrom_triton.CORE_WARPS)
            nystrom_triton.CORE_KEEP_MAX = keep_max if keep_max is not None else bsz
            nystrom_triton.PINV_BACKWARD_TRANSPOSED = transposed
            nystrom_triton.CORE_WARPS = core_warps or nystrom_triton.CORE_WARPS
            if split:  # NYSTROM_OVERLAP=1's form (here on one stream): Z from the core's kernels, then a bmm
                fn = lambda *t: nystrom_fast.times_w(  # noqa: E731
                    nystrom_fast.landmark_pinv(t[0], t[1], args.iters, "original", True, "tf32", True), t[2])
            else:
                fn = lambda *t, core=core: nystrom_fast.landmark_middle(  # noqa: E731
                    *t, args.iters, "original", True, "tf32", core_kernel=core)
            where[0] = f"the middle's {name} row at {bsz} matrices"
            try:
                out = fn(*xs)
                grads = torch.autograd.grad(out, xs, gout.bfloat16())
                launches = count_launches(lambda: torch.autograd.grad(fn(*xs), xs, gout.bfloat16()))
                # the forward as training runs it: inputs that require grad (a forward on detached ones keeps no
                # iterates, so the "iterates kept" rows would time the other form); the graph is dropped
                fwd = bench(lambda: fn(*xs))
                both = bench(lambda: torch.autograd.grad(fn(*xs), xs, gout.bfloat16()))
                errs = ", ".join(f"{rel(a, b):.1e}" for a, b in zip(grads, ref_grads))
                print(f"| {bsz} | {name} | {launches} | {fwd:.3f} | {both:.3f} | {rel(out, ref):.1e} | {errs} |")
            except Exception as exc:  # a row that does not compile or run is reported; the others still run
                print(f"| {bsz} | {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | | |")
                failures.append(failure(f"{name} at {bsz} matrices", exc))
            finally:
                (nystrom_triton.CORE_KEEP_MAX, nystrom_triton.PINV_BACKWARD_TRANSPOSED,
                 nystrom_triton.CORE_WARPS) = settings


# (row, landmark_core?, CORE_KEEP_MAX for the row — 0: the backward replays the forward, None: the forward keeps
# its iterates whatever the count —, split Z / Z·W as with NYSTROM_OVERLAP=1?, the iteration's backward
# transposed (112 / 96 KB of shared memory instead of 160 / 144: two programs per SM where the registers allow
# it), the core's warps per program — None: CORE_WARPS as set)
MIDDLES = [("PyTorch ops + pinv kernel (=1), direct backward", False, 0, False, False, None),
           ("PyTorch ops + pinv kernel (=1), transposed backward", False, 0, False, True, None),
           ("landmark_core (=all), backward replays, direct, 8 warps", True, 0, False, False, 8),
           ("landmark_core (=all), backward replays, direct, 4 warps", True, 0, False, False, 4),
           ("landmark_core (=all), backward replays, transposed, 8 warps", True, 0, False, True, 8),
           ("landmark_core (=all), backward replays, transposed, 4 warps", True, 0, False, True, 4),
           ("landmark_core (=all), iterates kept, transposed, 4 warps", True, None, False, True, 4),
           ("landmark_pinv + Z·W bmm (=all, overlap), iterates kept", True, None, True, True, None)]


def count_launches(fn):
    """CUDA kernels one call of fn launches (torch.profiler's device-side events); "n/a" without CUDA."""
    if not torch.cuda.is_available():
        return "n/a"
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def pinv_table(args, dev, failures, where):
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU, Triton interpreter (smoke run)"
    print(f"# pinv iteration ({args.iters} steps, m={args.m}), {device}, "
          f"torch {torch.__version__}")
    print("| matrices | impl | fwd ms | fwd+bwd ms | out err | grad err |")
    print("|---|---|---|---|---|---|")
    for bsz in args.matrices:
        g = torch.Generator(device="cpu").manual_seed(bsz)
        a64 = torch.softmax(torch.randn(bsz, args.m, args.m, generator=g, dtype=torch.float64) * 2, -1).to(dev)
        a64.requires_grad_()
        gout = torch.randn(bsz, args.m, args.m, generator=g, dtype=torch.float64).to(dev)
        ref = iterative_pinv(a64, args.iters)
        ref_grad = torch.autograd.grad(ref, a64, gout)[0]
        a = a64.detach().float().requires_grad_()
        variants = []
        for tf32 in (False, True):
            def torch_fn(x, tf32=tf32):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                return nystrom_fast.pinv_iterate(x, pinv_init(x), args.iters)
            variants.append((f"torch bmm{' tf32' if tf32 else ''}", torch_fn))
        variants = [(name, fn, False) for name, fn in variants]
        for prec in args.precisions:
            for w in args.warps:
                warps = tuple(int(x) for x in w.split(","))
                for form in args.backward_forms:
                    variants.append((f"triton {prec} warps {w}{' transposed' if form == 'transposed' else ''}",
                                     lambda x, prec=prec, warps=warps: nystrom_triton.pinv_iterate(
                                         x, pinv_init(x), args.iters, precision=prec, warps=warps),
                                     form == "transposed"))
        before = nystrom_triton.PINV_BACKWARD_TRANSPOSED
        for name, fn, transposed in variants:
            nystrom_triton.PINV_BACKWARD_TRANSPOSED = transposed
            where[0] = f"the {name} row at {bsz} matrices"
            try:
                out = fn(a)
                grad = torch.autograd.grad(out, a, gout.float())[0]
                fwd = bench(lambda: fn(a.detach()))
                both = bench(lambda: torch.autograd.grad(fn(a), a, gout.float()))
                print(f"| {bsz} | {name} | {fwd:.3f} | {both:.3f} | {rel(out, ref):.1e} | {rel(grad, ref_grad):.1e} |")
            except Exception as exc:  # a variant that does not compile (e.g. out of shared memory) is reported
                print(f"| {bsz} | {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | |")
                failures.append(failure(f"{name} at {bsz} matrices", exc))
            torch.backends.cuda.matmul.allow_tf32 = False
            nystrom_triton.PINV_BACKWARD_TRANSPOSED = before


if __name__ == "__main__":
    main()
