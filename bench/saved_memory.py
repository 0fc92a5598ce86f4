"""What a training step keeps for backward, and its peak: nystrom (each kernel mode) vs softmax. No GPU needed.

The tensors autograd saves during the forward are most of a training step's peak memory (issue #6: "peak memory
≤ the softmax model's"). This walks the autograd graph of one MLM forward and adds up the distinct storages its nodes save, parameters
excluded, and how much of that is sequence-sized (storages of at least half a (b, h, n, d) tensor); and it
records the most bytes the CPU allocator held during the forward + backward (torch.profiler's memory events),
which also counts tensors kept alive without being saved and the backward's temporaries. Counted on the CPU in
fp32 (Triton under its interpreter), so the bytes are twice a bf16 GPU run's for activations; the differences
between variants are what it is for. Each variant runs in its own process (the interpreter must be chosen
before Triton is imported).

    python bench/saved_memory.py                      # n 512, batch 2, 2 layers, BERT-base width
    python bench/saved_memory.py --verbose            # also every saved tensor over 100 KB
    python bench/saved_memory.py --mixed-precision    # under bf16 autocast, attention in fp32 (the shipped configs)

The "× softmax" columns divide by the softmax row's figures (n/a where it failed or its figure is 0). A variant
whose process fails is named under the table with its row n/a; the others are still measured, and the exit
status is 1. Stopped (SIGTERM from a time limit, or Ctrl-C), the script keeps the rows printed, says where it
stopped and exits 130 (bench/time_limit.py).
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))
from launch_count import ChildFailed, run_cpu_child  # noqa: E402
from time_limit import failure, finish, stop_on_sigterm  # noqa: E402

# (label, attention type, NYSTROM_TRITON, NYSTROM_OVERLAP, NYSTROM_RECOMPUTE)
VARIANTS = [("softmax (SDPA)", "softmax", "0", False, False), ("nystrom, PyTorch ops", "nystrom", "0", False, False),
            ("nystrom, NYSTROM_TRITON=1 (default)", "nystrom", "1", False, False),
            ("nystrom, NYSTROM_TRITON=all", "nystrom", "all", False, False),
            ("nystrom, NYSTROM_TRITON=all, NYSTROM_OVERLAP=1", "nystrom", "all", True, False),
            ("nystrom, NYSTROM_TRITON=all, NYSTROM_RECOMPUTE=1", "nystrom", "all", False, True)]


def saved_storages(root: torch.Tensor, exclude=(), min_bytes=0):
    """{storage pointer: (bytes, node name, shape)} for the tensors saved by the autograd graph behind root."""
    seen, stack, visited = {}, [root.grad_fn], set()
    exclude = set(exclude)

    def add(node, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in exclude or ptr in seen or storage.nbytes() < min_bytes:
            return
        seen[ptr] = (storage.nbytes(), type(node).__name__, tuple(t.shape))

    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for attr in dir(node):  # built-in nodes expose what they saved as _saved_<name>
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except Exception:  # an attribute that is not a tensor, or freed
                    continue
                for t in value if isinstance(value, (tuple, list)) else [value]:
                    add(node, t)
        try:
            for t in getattr(node, "saved_tensors", ()) or ():  # custom autograd.Functions
                add(node, t)
        except RuntimeError:
            pass
        stack.extend(fn for fn, _ in node.next_functions)
    return seen


def peak_allocated(prof) -> int:
    """Most bytes the CPU allocator held at once during a profile, counted from its start (torch.profiler's memory
    events; the Triton interpreter computes in numpy, but every tensor the host code allocates goes through it)."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"
              and e["args"].get("Device Type") == 0]
    return max(totals, default=0)


def collect_after_interpreted_launches():
    """Triton's interpreter keeps a launch's arguments in a reference cycle until the garbage collector runs (a
    kernel's output tensor outlives its last use; compiled kernels do not), which would count as memory the GPU
    frees at once. Collect after every interpreted launch."""
    from triton.runtime import interpreter
    launch = interpreter.GridExecutor.__call__

    def launch_and_collect(self, *args, **kwargs):
        result = launch(self, *args, **kwargs)
        gc.collect()
        return result
    interpreter.GridExecutor.__call__ = launch_and_collect


def measure(attn_type: str, n: int, batch: int, layers: int, verbose: bool,
            mixed_precision: bool = False) -> tuple[float, float, float, list]:
    from contextlib import nullcontext
    from dataclasses import replace
    from nystromformer.config import ModelConfig
    from nystromformer.model import NystromformerForMaskedLM
    # Mixed precision: bf16 autocast with the attention in fp32, as the shipped configs train (the Triton
    # interpreter cannot compute in bf16, so the attention must stay fp32 here).
    cfg = ModelConfig(max_seq_len=n, num_layers=layers, vocab_size=1000, conv_kernel_size=33,
                      attention_fp32=mixed_precision)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed_precision else nullcontext()
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(replace(cfg, attn_type=attn_type)).train()
    for module in model.modules():
        if hasattr(module, "impl"):
            module.impl = "fast"  # the CUDA path's code, here on the CPU
    ids = torch.randint(5, 1000, (batch, n))
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]
    if os.environ.get("TRITON_INTERPRET") == "1":
        collect_after_interpreted_launches()
    # Peak: one forward + backward (no optimizer step: the same for every variant), from the step's first
    # allocation; parameter gradients included (the conv's are the only ones that differ, 33 × h floats a layer).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with autocast:
            loss = model(ids, labels, None).loss  # no padding, as pretraining
        params = [p.untyped_storage().data_ptr() for p in model.parameters()]
        saved = saved_storages(loss, exclude=params)
        loss.backward()
    peak = peak_allocated(prof)
    total = sum(b for b, _, _ in saved.values())
    # Sequence-sized: at least half a (b, h, n, d) tensor in fp32, with a dimension of n or b·n (the same storage
    # may be saved as (b, h, n, d) by one node and flattened to (b·n, dim) by another, and the walk meets either
    # first; the joined q, k, v weight, 3·dim × dim, is over the size but does not grow with n).
    half = batch * n * cfg.transformer_dim * 4 // 2
    growing = sum(b for b, _, shape in saved.values() if b >= half and {n, batch * n} & set(shape))
    by_node = collections.Counter()
    for nbytes, name, _ in saved.values():
        by_node[name] += nbytes
    if verbose:
        for nbytes, name, shape in sorted(saved.values(), reverse=True):
            if nbytes >= 100_000:
                print(f"#   {name} {shape} {nbytes / 2**20:.2f} MiB", file=sys.stderr)
    return total, growing, peak, by_node.most_common(6)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--mixed-precision", action="store_true",
                    help="under bf16 autocast with attention_fp32 true (the shipped configs); default fp32 throughout")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        total, growing, peak, top = measure(args.child, args.n, args.batch, args.layers, args.verbose,
                                            args.mixed_precision)
        print(total, growing, peak, "; ".join(f"{name} {b / 2**20:.1f}" for name, b in top))
        return
    print(f"# saved for backward, one MLM forward, n={args.n}, batch={args.batch}, {args.layers} layers of BERT-base "
          f"width, no padding, "
          f"{'bf16 autocast with fp32 attention' if args.mixed_precision else 'fp32'} on the CPU (Triton "
          f"interpreted), parameters excluded")
    print("| variant | saved MiB | of which sequence-sized | × softmax (sequence-sized) | peak fwd+bwd MiB "
          "| × softmax (peak) | largest saved, by node (MiB) |")
    print("|---|---|---|---|---|---|---|")
    stop_on_sigterm()
    base = base_peak = None  # the softmax row's figures (the first variant's)
    failures, stopped = [], None
    try:
        for label, attn, kernels, overlap, recompute in VARIANTS:
            stopped = f"the variant {label}"
            try:
                total, growing, peak, top = run_variant(args, attn, kernels, overlap, recompute, label)
            except ChildFailed as error:
                failures.append(failure(label, error))
                print(f"| {label} | n/a | n/a | n/a | n/a | n/a | n/a |", flush=True)
                continue
            if attn == "softmax":
                base, base_peak = growing, peak
            print(f"| {label} | {total / 2**20:.1f} | {growing / 2**20:.1f} | {ratio(growing, base)} "
                  f"| {peak / 2**20:.1f} | {ratio(peak, base_peak)} | {top} |", flush=True)
        stopped = None
    except KeyboardInterrupt:
        pass  # stopped names the variant under way
    finish(failures, stopped)


def ratio(value: int, base) -> str:
    """value / the softmax row's, or n/a when there is none (its process failed) or it is 0."""
    return f"{value / base:.3f}" if base else "n/a"


def run_variant(args, attn, kernels, overlap, recompute, label) -> tuple:
    """(saved bytes, of which sequence-sized, peak bytes, the largest saved by node) of one variant, measured in a
    process of its own; ChildFailed when it fails."""
    cmd = [sys.executable, __file__, "--n", str(args.n), "--batch", str(args.batch), "--layers", str(args.layers),
           "--child", attn] + (["--verbose"] if args.verbose else []) + (
               ["--mixed-precision"] if args.mixed_precision else [])
    proc = run_cpu_child(cmd, kernels, overlap, recompute)
    if args.verbose:
        print(f"# {label}\n{proc.stderr.strip()}")
    total, growing, peak, top = proc.stdout.strip().splitlines()[-1].split(" ", 3)
    return int(total), int(growing), int(peak), top

if __name__ == "__main__":
    main()
