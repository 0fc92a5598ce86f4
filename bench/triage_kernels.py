"""Which NYSTROM_TRITON=all kernel faults on this GPU? Each case (one kernel or the whole layer, forward and
backward, at one shape) runs in its own process — an illegal memory access kills the CUDA context, and without
CUDA_LAUNCH_BLOCKING the error surfaces at some later, innocent kernel. With --sanitize, the first failing case
is run again under compute-sanitizer's memcheck, which names the kernel and the bad address.

    python bench/triage_kernels.py [--sanitize]          # the table of cases
    python bench/triage_kernels.py --case lk:bf16:16:1000  # one case, in this process (CPU: TRITON_INTERPRET=1)
    python bench/triage_kernels.py --cases lq:fp32:64:1000:BLOCK_K=32,num_warps=4  # pass 1 backward variants

Every case prints the output's and gradients' relative errors against an fp64 reference (SDPA, or the PyTorch
path). A case may end in overrides: of pass 1's backward launch constants ("lq"), or of the core's warps
("core:bf16:16:1000:num_warps=4").
"""
import argparse
import concurrent.futures
import os
import subprocess
import sys

import torch

KINDS = ("lq", "lk", "core", "layer-unfused", "layer-fused")


def run_case(spec: str) -> None:
    from nystromformer.attention import nystrom_fast, nystrom_triton as nt
    kind, dtype_name, d, n, *override = spec.split(":")
    if override:  # pass 1: its backward's launch constants; core: its warps (num_warps=N)
        extra = {key: (val if key == "PREC" else int(val)) for key, val in
                 (item.split("=") for item in override[0].split(","))}
        plain = nt._lq_consts
        nt._lq_consts = lambda q_land, backward: {**plain(q_land, backward), **(extra if backward else {})}
        if "num_warps" in extra and kind == "core":
            nt._core_warps = lambda m, d: extra["num_warps"]
    dtype, d, n = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype_name]), int(d), int(n)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", nargs="+", help="run these cases in this process (one line each)")
    p.add_argument("--cases", nargs="+", help="these cases instead of the table's")
    p.add_argument("--sanitize", type=int, default=0, metavar="N",
                   help="run the first N failing cases again under compute-sanitizer memcheck")
    args = p.parse_args()
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
    env = dict(os.environ, NYSTROM_TRITON="all", CUDA_LAUNCH_BLOCKING="1")
    print(f"# NYSTROM_TRITON=all kernels, one process per case (b=4, h=3, m=64, padding), "
          f"{torch.cuda.get_device_name()}\n| case | result |\n|---|---|", flush=True)
    specs = args.cases or [f"{kind}:{dtype}:{d}:{n}" for kind in KINDS for dtype in ("bf16", "fp32")
                           for d in (16, 64) for n in (1000, 512)]

    def one(spec):  # four at a time: each process spends most of its time importing and compiling
        return subprocess.run([sys.executable, __file__, "--case", spec], env=env, capture_output=True, text=True,
                              timeout=300)

    failing = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for spec, r in zip(specs, pool.map(one, specs)):
            lines = [x for x in r.stderr.splitlines() if "Error" in x or "error" in x]
            ok = "ok " + r.stdout.strip().replace("\n", "; ")
            print(f"| {spec} | {ok if r.returncode == 0 else (lines[-1] if lines else r.returncode)} |", flush=True)
            if r.returncode:
                failing.append(spec)
    for spec in failing[:args.sanitize]:
        print(f"\n# compute-sanitizer memcheck, {spec} (host frames left out)", flush=True)
        r = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--print-limit", "4",
                            sys.executable, __file__, "--case", spec],
                           env=dict(env, CUDA_LAUNCH_BLOCKING="0"), capture_output=True, text=True, timeout=150)
        print("\n".join([x for x in (r.stdout + r.stderr).splitlines() if "Host Frame" not in x][:60]))


if __name__ == "__main__":
    main()
