"""Bytes each Triton kernel of the Nyström layer reads and writes, forward + backward: how far the layer's memory
traffic is from issue #6's bandwidth floor, counted on the CPU.

Issue #6's floor is reading q, k, v, o, dO and writing o, dq, dk, dv once: 9 "tensors" of b·h·n·d elements
(`bench/attention_speed.py`'s "x floor" since 2026-11-29; its tables before counted 12, the backward reading q, k,
v again, and by that floor the H100 timed the `NYSTROM_TRITON=all` layer at 7.1–8.6×, 9.5–11.5× by the issue's:
docs/performance.md). Is the rest extra
bytes (passes over the n-long tensors that fusion could remove) or kernels below the copy bandwidth (launch
settings)? This runs one forward + backward of the one-node layer under Triton's interpreter and adds up, per
kernel launch, the elements every load and store touches (masked-off lanes excluded):

* unique bytes: each address counted once per launch — the DRAM traffic if every re-read hits the cache (L2 is
  50 MB on an H100; a (batch, head)'s tile of q, k, v is far smaller), a lower bound;
* requested bytes: every load and store as issued — the traffic if none hit, an upper bound.

Both in units of one input tensor (b·h·n·d elements of q's dtype). The landmark-sized kernels (the core, the m × m
statistics) move next to nothing at long n; their share shows at n = 512. PyTorch's own operators in this path
(without padding, 2 sums of per-program partials, which grow with n) are rows too, each input read once and each
output written once (``aten.``…). Not counted: the model's projections around the layer.

    python bench/bytes_moved.py                         # n = 512 and 4096, bf16, no padding
    python bench/bytes_moved.py --dtype fp32 --pad      # fp32 attention (the shipped configs), padded rows

Runs on the CPU (TRITON_INTERPRET=1, set here); one (batch, head) — the counts per (batch, head) do not depend
on how many there are. A count, not a timing: the times are the GPU's (`bench/attention_speed.py --kernels`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("NYSTROM_TRITON", "all")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

MOVES_NOTHING = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                 "_unsafe_view", "detach"}  # allocations, metadata, views dispatch does not mark as such
FLOOR_TENSORS = 9  # read q, k, v, o, dO; write o, dq, dk, dv (issue #6)
# the floor of attention_speed.py's tables before 2026-11-29 (q, k, v read again by the backward), which the
# H100 figures of docs/performance.md are in: a ratio to it sets these bytes beside those tables' "× floor"
OLD_TABLES_FLOOR_TENSORS = 12


class Traffic:
    """Per launch: the kernel's name, the phase, and every address its loads and stores touched."""

    def __init__(self):
        self.launches = []  # [name, phase, {"read": [addresses...], "write": [...]}, {"read": bytes, ...}]
        self.phase = "forward"
        self.current = None

    @contextlib.contextmanager
    def recording(self):
        """Every kernel launch and PyTorch operator inside the block is recorded; the interpreter's own functions
        are restored after it."""
        run = interpreter.InterpretedFunction.run
        load = interpreter.InterpreterBuilder.create_masked_load
        store = interpreter.InterpreterBuilder.create_masked_store
        traffic = self

        def counted_run(fn, *args, **kwargs):
            traffic.current = [fn.fn.__name__, traffic.phase, defaultdict(list), defaultdict(int)]
            traffic.launches.append(traffic.current)
            try:
                return run(fn, *args, **kwargs)
            finally:
                traffic.current = None

        def note(kind, ptrs, mask):
            if traffic.current is None:
                return
            size = ptrs.get_element_ty().primitive_bitwidth // 8
            touched = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))[
                np.broadcast_to(mask.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))]
            _, _, addresses, requested = traffic.current
            addresses[kind].append((touched.astype(np.uint64), size))
            requested[kind] += touched.size * size

        def counted_load(builder, ptrs, mask, *args, **kwargs):
            note("read", ptrs, mask)
            return load(builder, ptrs, mask, *args, **kwargs)

        def counted_store(builder, ptrs, value, mask, *args, **kwargs):
            note("write", ptrs, mask)
            return store(builder, ptrs, value, mask, *args, **kwargs)

        interpreter.InterpretedFunction.run = counted_run
        interpreter.InterpreterBuilder.create_masked_load = counted_load
        interpreter.InterpreterBuilder.create_masked_store = counted_store
        try:
            with self.aten_mode():
                yield self
        finally:
            interpreter.InterpretedFunction.run = run
            interpreter.InterpreterBuilder.create_masked_load = load
            interpreter.InterpreterBuilder.create_masked_store = store

    def aten_mode(self):
        """A dispatch mode that records each PyTorch operator outside the kernels as a launch: its tensor inputs read,
        its outputs written, once (allocations and views move nothing)."""
        traffic = self

        def tensors(tree):
            return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if traffic.current is None and not (func.is_view or name in MOVES_NOTHING):
                    read = sum(t.numel() * t.element_size() for t in tensors((args, kwargs)))
                    written = sum(t.numel() * t.element_size() for t in tensors(out))
                    traffic.launches.append([f"aten.{name}", traffic.phase, {}, {"read": read, "write": written}])
                return out
        return Record()

    def table(self, unit: int):
        """Rows (kernel, phase, launches, unique read, requested read, unique write, requested write), in units."""
        rows = {}
        for name, phase, addresses, requested in self.launches:
            row = rows.setdefault((name, phase), [0, 0.0, 0.0, 0.0, 0.0])
            row[0] += 1
            for i, kind in enumerate(("read", "write")):
                if not addresses:  # a PyTorch operator: what it reads and writes, once
                    row[1 + 2 * i] += requested[kind] / unit
                    row[2 + 2 * i] += requested[kind] / unit
                    continue
                by_size = defaultdict(list)  # every load (store) of the launch: its programs and loop steps
                for touched, size in addresses[kind]:
                    by_size[size].append(touched)
                unique = sum(np.unique(np.concatenate(parts)).size * size for size, parts in by_size.items())
                row[1 + 2 * i] += unique / unit
                row[2 + 2 * i] += requested[kind] / unit
        return [(name, phase, *values) for (name, phase), values in rows.items()]


def measure(n: int, dtype: torch.dtype, pad: bool, m: int = 64, d: int = 64, conv: int = 33, seed: int = 0):
    """One forward + backward of the one-node layer on one (batch, head): the table's rows (``Traffic.table``)."""
    from nystromformer.attention import nystrom_fast
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(1, n, 1, d, generator=g).to(dtype).requires_grad_() for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in leaves)  # (b, h, n, d) views of (b, n, h, d), as the model's
    weight = torch.randn(1, 1, conv, 1, generator=g, requires_grad=True)
    mask = None
    if pad:  # a quarter of the row is padding
        mask = torch.ones(1, n)
        mask[:, n - n // 4:] = 0

    def layer():
        return nystrom_fast.forward(q, k, v, mask, num_landmarks=m, conv_weight=weight, use_triton=True)
    layer().float().square().sum().backward()  # warm-up, not recorded
    for t in leaves + [weight]:
        t.grad = None
    traffic = Traffic()
    # the output's gradient in q's layout, as the output projection's backward gives it; made before recording
    grad = torch.randn(1, n, 1, d, generator=g).to(dtype).transpose(1, 2)
    with traffic.recording():
        out = layer()
        traffic.phase = "backward"
        out.backward(grad)
    return traffic.table(n * d * leaves[0].element_size())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="q, k, v's dtype: bf16 (attention_fp32 false) or fp32 (true, the shipped configs)")
    ap.add_argument("--pad", action="store_true", help="a quarter of the row padded (a mask); default: none")
    args = ap.parse_args(argv)
    if os.environ["NYSTROM_TRITON"] != "all":
        raise SystemExit("bytes_moved.py counts the one-node layer's kernels: NYSTROM_TRITON must be 'all' (or unset)")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    print(f"# bytes moved per kernel, one forward + backward of the NYSTROM_TRITON=all layer, {args.dtype}, "
          f"head_dim 64, 64 landmarks, conv 33, {'a quarter padded' if args.pad else 'no padding'}; in units of one "
          f"b·h·n·d tensor of q's dtype (issue #6's floor: {FLOOR_TENSORS}); counted under Triton's interpreter")
    for n in args.lengths:
        rows = measure(n, dtype, args.pad)
        print(f"\n## n = {n}\n")
        print("| kernel | phase | launches | read: unique / requested | written: unique / requested |")
        print("|---|---|---|---|---|")
        totals = [0.0] * 4
        for name, phase, launches, *values in rows:
            totals = [a + b for a, b in zip(totals, values)]
            print(f"| {name} | {phase} | {launches} | {values[0]:.2f} / {values[1]:.2f} | "
                  f"{values[2]:.2f} / {values[3]:.2f} |")
        unique, requested = totals[0] + totals[2], totals[1] + totals[3]
        print(f"| **total** | | {sum(r[2] for r in rows)} | {totals[0]:.2f} / {totals[1]:.2f} | "
              f"{totals[2]:.2f} / {totals[3]:.2f} |")
        old = OLD_TABLES_FLOOR_TENSORS
        print(f"\nread + written: {unique:.2f} tensors unique ({unique / FLOOR_TENSORS:.2f}× issue #6's floor of "
              f"{FLOOR_TENSORS}, as attention_speed.py's; {unique / old:.2f}× the floor of {old} of its tables "
              f"before 2026-11-29), {requested:.2f} requested ({requested / FLOOR_TENSORS:.2f}×, "
              f"{requested / old:.2f}×)")


if __name__ == "__main__":
    main()
