"""Kernel launches per attention layer, forward + backward: a device-independent count of the host's work.

The H100 model step was host-bound for Nyström (59 ms of device time in a 95 ms step at n = 512,
docs/performance.md): the host could not issue the layers' many small kernels fast enough. This counts, for one
attention core (q, k, v → out, then backward to q, k, v and the conv weight), the operations that become kernel
launches on a GPU: every aten operator that is not a view or an allocation (TorchDispatchMode sees the backward
too) plus every Triton kernel launch. Runs on the CPU (Triton kernels under TRITON_INTERPRET=1, which this script
sets); the counts are those of the GPU path except where PyTorch picks a different decomposition on CPU (SDPA is
one operator either way here).

    python bench/launch_count.py                 # n = 512, 64 landmarks, conv 33, 2 heads × 64
    python bench/launch_count.py --verbose       # and which operators
    python bench/launch_count.py --host-time     # and the host's own work around the launches
    python bench/launch_count.py --step          # per encoder layer of a whole MLM training step instead
    python bench/launch_count.py --step --accumulate  # and per further micro-batch of a step

Prints one Markdown table: launches (aten / Triton) for softmax (SDPA) and the Nyström fast path with
NYSTROM_TRITON=0, 1 and all, with a padding mask and with mask=None (rows without padding, as in pretraining).
``--host-time`` adds, per variant with Triton kernels, the host's own work around the launches: the median time of
one forward + backward with each launch's body skipped (``kernel[grid](...)`` returns at once; the outputs are
then garbage, but no step of this path depends on values), i.e. our Python, autograd, dispatch and the aten
operators on these CPU tensors. With NYSTROM_TRITON=1 those operators include the SDPA passes and the m × m
products, computed on the CPU, so only the ``all`` rows are host work alone. What a launch itself costs a GPU's
host comes on top, once per launch counted; its Python part is the last column, "Triton's binding": Triton 3.6's
own work per launch before its C++ launcher (switches, argument binding and specialization, the kernel cache's
lookup), for an sm_90 target with each launch's own arguments, summed over the layer's Triton launches.
A comparison between variants and commits on one machine, not a GPU host's figure.
``--step`` counts instead the launches one encoder layer adds to a whole MLM training step (forward, loss and
backward under bf16 autocast, as ``mixed_precision`` pretraining runs; a 2-layer model's count less a 1-layer
model's): the attention core above plus the projections, their casts, the feed-forward, LayerNorms and dropouts.
The optimizer's step (fused AdamW: a few launches per model) is not counted. ``--accumulate`` adds what each
further micro-batch adds to a step (gradient accumulation: the shipped configs run 8 rows a micro-batch, so a
256-row step on one GPU is 32 micro-batches), in the loop pretraining had before the twentieth session (an autocast
region per micro-batch, the backward inside it) and as it runs them now (one region and ``model.fixed_weights``,
so the weights' casts are made once a step; the backward outside autocast). ``--accumulate`` needs ``--step``;
``--host-time`` is of the attention core's table only (not with ``--step``).

Each count runs in a child process. One that fails leaves its cell n/a and is named under the table; the other
cells are still counted, and the exit status is 1. Stopped (SIGTERM from a time limit, or Ctrl-C), the script
keeps the rows printed, says where it stopped and exits 130 (bench/time_limit.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from time_limit import failure, finish, stop_on_sigterm

ROOT = Path(__file__).resolve().parents[1]
# Operators that launch nothing: allocations, metadata, and views that autograd's dispatch does not mark as such.
NOT_LAUNCHES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                "promote_types", "_unsafe_view"}


RECORDED = None  # when a list: every Triton launch's (function, arguments, keyword arguments)


def triton_binding_us(launches) -> float:
    """µs of Triton's own host work before its C++ launcher, summed over ``launches``: what
    ``JITFunction.run`` does on every launch of a compiled kernel — read its switches, bind and specialize the
    arguments (types, alignment, integers equal to 1 or divisible by 16) and look the kernel up in its cache —
    for an sm_90 target, timed here with each launch's own arguments (fastest of 5 runs of 200). Triton 3.6's
    internals; what the C++ launcher and the driver then take is not in it."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature
    backend = make_backend(GPUTarget("cuda", 90, 32))
    total = 0.0
    for fn, a, kw in launches:
        jitted = JITFunction(fn)
        binder, cache = create_function_from_signature(jitted.signature, jitted.params, backend), {}

        def front():
            options = dict(kw, debug=kw.get("debug") or knobs.runtime.debug,
                           instrumentation_mode=knobs.compilation.instrumentation_mode)
            _, specialization, options = binder(*a, **options)
            compute_cache_key(cache, specialization, options)
        for _ in range(20):
            front()
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(200):
                front()
            runs.append((time.perf_counter() - start) / 200)
        total += min(runs)
    return total * 1e6


def counters(args):
    """(launches Counter, a TorchDispatchMode that fills it, [Triton launches], [skip kernel bodies]): the aten
    operators that launch a kernel, and the Triton launches (counted where the interpreter runs one)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    launches = Counter()
    inside_kernel = [False]  # the interpreter's own tensor handling is not the layer's

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not (func.is_view or name in NOT_LAUNCHES or inside_kernel[0]):
                launches[name] += 1
            return func(*args, **(kwargs or {}))

    triton_launches, skip_kernels = [0], [False]
    if args.variant.startswith("nystrom") and os.environ.get("NYSTROM_TRITON") != "0":
        from triton.runtime import interpreter
        run = interpreter.InterpretedFunction.run  # one call per launch: kernel[grid](...)

        def counted(self, *a, **kw):
            triton_launches[0] += 1
            if RECORDED is not None:
                RECORDED.append((self.fn, a, {k: v for k, v in kw.items() if k not in ("grid", "warmup")}))
            if skip_kernels[0]:
                return None
            inside_kernel[0] = True
            try:
                return run(self, *a, **kw)
            finally:
                inside_kernel[0] = False
        interpreter.InterpretedFunction.run = counted
    return launches, Count, triton_launches, skip_kernels


def count(args) -> None:
    """In a child process with NYSTROM_TRITON and TRITON_INTERPRET set: print 'aten triton' for one variant."""
    sys.path.insert(0, str(ROOT / "code"))
    import torch
    import torch.nn.functional as F

    from nystromformer.attention import nystrom_fast

    launches, Count, triton_launches, skip_kernels = counters(args)
    b, h, n, d = 1, args.heads, args.n, 64
    # q, k, v as (b, n, h, d) tensors seen as (b, h, n, d); the model's are views of one (b, n, 3, h, d)
    # projection, which changes no count here (its joining copy in the backward is the model's: --step)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    leaves = [torch.randn(b, n, h, d, dtype=dtype, requires_grad=True) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    w = torch.randn(h, 1, 33, 1, requires_grad=True)
    mask = None if args.mask == "none" else torch.ones(b, n)
    if args.variant == "softmax":
        fn = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q, k, v, attn_mask=None if mask is None else mask[:, None, None, :].bool())
    else:
        fn = lambda: nystrom_fast.forward(q, k, v, mask, num_landmarks=64, conv_weight=w,  # noqa: E731
                                          use_triton=os.environ["NYSTROM_TRITON"] != "0")
    fn().sum().backward()  # warm-up: Triton's first launch compiles / builds the launcher
    triton_launches[0] = 0
    for t in leaves + [w]:
        t.grad = None  # else backward adds into the warm-up's gradients: launches the model (zero_grad) does not
    with Count():
        out = fn()
        out.sum().backward()
    launches.subtract({"sum": 1, "ones_like": 1})  # the harness's loss and its gradient seed
    launches = +launches
    counted_launches = sum(launches.values()), triton_launches[0]
    host_us = ""
    if args.host_time:
        skip_kernels[0] = True
        samples = []
        for _ in range(args.repeats + 3):  # the first 3 warm up
            for t in leaves + [w]:
                t.grad = None
            start = time.perf_counter()
            fn().sum().backward()
            samples.append(time.perf_counter() - start)
        host_us = f" {statistics.median(samples[3:]) * 1e6:.0f}"
        if triton_launches[0]:
            global RECORDED
            RECORDED, skip_kernels[0] = [], False
            fn().sum().backward()
            host_us += f" {triton_binding_us(RECORDED):.0f}"
    print(*counted_launches, end=host_us + "\n")
    if args.verbose:
        print(dict(launches.most_common()), file=sys.stderr)


def count_step(args) -> None:
    """In a child process: print 'aten triton' for one encoder layer of a training step (2 layers less 1)."""
    sys.path.insert(0, str(ROOT / "code"))
    from dataclasses import replace

    import torch

    from nystromformer.config import ModelConfig
    from nystromformer.model import NystromformerForMaskedLM, fixed_weights

    launches, Count, triton_launches, _ = counters(args)
    cfg = ModelConfig(vocab_size=1000, max_seq_len=args.n, embedding_dim=64 * args.heads,
                      transformer_dim=64 * args.heads, transformer_hidden_dim=256 * args.heads, num_head=args.heads,
                      head_dim=64, attn_type=args.variant, num_landmarks=64, conv_kernel_size=33,
                      attention_fp32=args.dtype == "fp32")
    micro_batches = getattr(args, "micro_batches", 1)
    ids = torch.randint(5, 1000, (micro_batches, args.n))
    labels = torch.where(torch.rand(micro_batches, args.n) < 0.15, ids, -100)
    totals = []
    for layers in (1, 2):
        torch.manual_seed(0)
        model = NystromformerForMaskedLM(replace(cfg, num_layers=layers)).train()

        def micro_batch(i, backward_under_autocast=False):
            loss = model(ids[i:i + 1], labels[i:i + 1], None).loss  # no padding, as pretraining
            with torch.autocast("cpu", enabled=backward_under_autocast):
                loss.backward()

        def step():
            model.zero_grad(set_to_none=True)  # as pretraining: the first backward writes each gradient
            if getattr(args, "loop", "new") == "new":  # pretraining: one autocast region, fixed weights
                with torch.autocast("cpu", dtype=torch.bfloat16), fixed_weights(model):
                    for i in range(micro_batches):
                        micro_batch(i)
            else:  # the loop before: a region per micro-batch (every weight cast again), backward inside it
                for i in range(micro_batches):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        micro_batch(i, backward_under_autocast=True)
        step()  # warm-up: Triton's first launch compiles / builds the launcher
        launches.clear()
        triton_launches[0] = 0
        with Count():
            step()
        totals.append((Counter(launches), triton_launches[0]))
    (aten_1, triton_1), (aten_2, triton_2) = totals
    per_layer = aten_2 - aten_1
    print(sum(per_layer.values()), triton_2 - triton_1)
    if args.verbose:
        print(dict(per_layer.most_common()), file=sys.stderr)


ROWS = [("softmax (SDPA)", "softmax", "-"), ("nystrom, PyTorch ops", "nystrom", "0"),
        ("nystrom, NYSTROM_TRITON=1 (default)", "nystrom", "1"), ("nystrom, NYSTROM_TRITON=all", "nystrom", "all"),
        # Z apart from Z·W (on CUDA on a second stream; the counts are the same on one)
        ("nystrom, NYSTROM_TRITON=1, NYSTROM_OVERLAP=1", "nystrom", "1+overlap"),
        ("nystrom, NYSTROM_TRITON=all, NYSTROM_OVERLAP=1", "nystrom", "all+overlap"),
        # the landmark-sized tensors recomputed in the backward instead of kept
        ("nystrom, NYSTROM_TRITON=all, NYSTROM_RECOMPUTE=1", "nystrom", "all+recompute")]


class ChildFailed(RuntimeError):
    """A child process exited badly: its exit status and the last line of its stderr."""


def run_cpu_child(cmd: list, kernels: str, overlap: bool = False, recompute: bool = False):
    """``cmd`` (a script's own --child run) with these kernel switches on the CPU: Triton interpreted, the fast
    path's code (the CUDA path's), one thread. Its CompletedProcess; ChildFailed when it exits badly."""
    env = dict(os.environ, TRITON_INTERPRET="1", NYSTROM_TRITON=kernels, NYSTROM_OVERLAP=str(int(overlap)),
               NYSTROM_RECOMPUTE=str(int(recompute)), NYSTROM_IMPL="fast", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or ["(no message)"]
        raise ChildFailed(f"exit status {proc.returncode}: {last[0].strip()}")
    return proc


def validate_args(ap, args) -> None:
    """Flags that only mean something together (also what a dry run checks)."""
    if args.accumulate and not args.step:
        ap.error("--accumulate counts the micro-batches of a training step: give it with --step")
    if args.host_time and args.step:
        ap.error("--host-time times the attention core's forward + backward (the default table), not --step's "
                 "training step: give one or the other")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--heads", type=int, default=2, help="the counts do not depend on it (nor on n >= 64)")
    ap.add_argument("--verbose", action="store_true", help="also print the operators counted, per variant")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="q, k, v as the model passes them: fp32 with attention_fp32 true (the paper's), bf16 without")
    ap.add_argument("--host-time", action="store_true",
                    help="also time the host's work outside the kernels (median µs of one forward + backward); "
                         "not with --step")
    ap.add_argument("--repeats", type=int, default=200, help="forward + backward runs timed for --host-time")
    ap.add_argument("--step", action="store_true",
                    help="count per encoder layer of a whole MLM training step (bf16 autocast; --dtype fp32 = "
                         "attention_fp32 true, the shipped configs, bf16 = false), with no padding")
    ap.add_argument("--accumulate", action="store_true",
                    help="with --step: count the first micro-batch of a step and each further one, in the old "
                         "pretraining loop and in today's (one autocast region + fixed_weights)")
    ap.add_argument("--micro-batches", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--loop", choices=["old", "new"], default="new", help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "MASK"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    validate_args(ap, args)
    if args.child:
        args.variant, args.mask = args.child
        return count_step(args) if args.step else count(args)
    stop_on_sigterm()
    print_header(args)
    failures, stopped = [], None
    try:
        for label, variant, mode in ROWS[:4] if args.step else ROWS:
            stopped = f"the row {label}"
            cells = (step_cells if args.step else core_cells)(args, label, variant, mode, failures)
            print(f"| {label} | {' | '.join(cells)} |", flush=True)
        stopped = None
    except KeyboardInterrupt:
        pass  # stopped names the row under way
    finish(failures, stopped, "Failed (its cell is n/a)")


def print_header(args) -> None:
    if args.step:
        print(f"# launches per encoder layer of one MLM training step (forward, loss, backward; bf16 autocast, "
              f"attention_fp32 {str(args.dtype == 'fp32').lower()}), n={args.n}, heads={args.heads}, head_dim=64, "
              f"64 landmarks, conv 33, no padding (counted on the CPU; Triton under its interpreter)")
        if not args.accumulate:
            print("| variant | aten + Triton = total |")
            print("|---|---|")
        else:
            print("# first micro-batch of a step / each further one (gradient accumulation: 2 micro-batches less 1); "
                  "old loop: an autocast region per micro-batch, backward inside it; new: pretraining's one region "
                  "with fixed_weights, backward outside autocast")
            print("| variant | old loop: first / each further | new loop: first / each further |")
            print("|---|---|---|")
        return
    print(f"# launches per attention layer, forward + backward, {args.dtype}, n={args.n}, heads={args.heads}, "
          f"head_dim=64, "
          f"64 landmarks, conv 33 (counted on the CPU; Triton under its interpreter)")
    host = (" | host µs around the launches, mask / mask=None | Triton's binding µs, mask / mask=None"
            if args.host_time else "")
    print(f"| variant | padding mask: aten + Triton = total | mask=None: aten + Triton = total{host} |")
    print("|---|---|---|" + ("---|---|" if args.host_time else ""), flush=True)


def step_cells(args, label, variant, mode, failures) -> list:
    """--step's cells of one variant; a count whose child fails is n/a, named in ``failures``."""
    if not args.accumulate:
        try:
            aten, triton, _ = run_child(args, variant, mode, "none", label)
            return [f"{aten} + {triton} = {aten + triton}"]
        except ChildFailed as error:
            failures.append(failure(label, error))
            return ["n/a"]
    cells = []
    for loop in ("old", "new"):
        try:
            one, two = (sum(run_child(argparse.Namespace(**{**vars(args), "micro_batches": k, "loop": loop}),
                                      variant, mode, "none", label)[:2]) for k in (1, 2))
            cells.append(f"{one} / {two - one}")
        except ChildFailed as error:
            failures.append(failure(f"{label}, {loop} loop", error))
            cells.append("n/a")
    return cells


def core_cells(args, label, variant, mode, failures) -> list:
    """The attention core's cells of one variant (each mask, then --host-time's), as step_cells."""
    cells, hosts, bindings = [], [], []
    for mask, mask_name in (("ones", "padding mask"), ("none", "mask=None")):
        try:
            aten, triton, host_us = run_child(args, variant, mode, mask, label)
        except ChildFailed as error:
            failures.append(failure(f"{label}, {mask_name}", error))
            cells.append("n/a")
            hosts.append("n/a")
            bindings.append("n/a")
            continue
        cells.append(f"{aten} + {triton} = {aten + triton}")
        # without Triton kernels the time is the operators' own CPU compute, not host overhead
        hosts.append(host_us[0] if triton and host_us else "n/a")
        bindings.append(host_us[1] if triton and len(host_us) > 1 else "n/a")
    return cells + ([" / ".join(hosts), " / ".join(bindings)] if args.host_time else [])


def run_child(args, variant, mode, mask, label=None):
    """(aten launches, Triton launches, [host µs]) of one variant, counted in a child process."""
    kernels, _, switch = mode.partition("+")
    cmd = [sys.executable, __file__, "--n", str(args.n), "--heads", str(args.heads), "--dtype", args.dtype,
           "--child", variant, mask]
    if args.verbose:
        cmd.append("--verbose")
    if args.step:
        cmd += ["--step", "--micro-batches", str(getattr(args, "micro_batches", 1)), "--loop",
                getattr(args, "loop", "new")]
    if args.host_time:
        cmd += ["--host-time", "--repeats", str(args.repeats)]
    proc = run_cpu_child(cmd, kernels if kernels != "-" else "0", overlap=switch == "overlap",
                         recompute=switch == "recompute")
    if args.verbose:
        print(f"# {label or variant}, mask {mask}: {proc.stderr.strip()}")
    aten, triton, *host_us = proc.stdout.strip().splitlines()[-1].split()
    return int(aten), int(triton), host_us


if __name__ == "__main__":
    main()
