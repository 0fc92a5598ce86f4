"""Compile every Triton kernel of the Nyström fast path for a GPU target without a GPU; report resources.

For each kernel, in the configurations the host code launches at head_dim 64 and 64 landmarks (bf16 and fp32),
this compiles with Triton for the target (default sm_90, the H100/H200) and runs Triton's bundled ``ptxas -v`` on
the PTX: shared memory per block, registers per thread and bytes spilled. Spills and shared memory over the
device's limit (227 KB on Hopper) are what made the first pinv kernel 20× slower than it should have been.

    .venv/bin/python bench/triton_compile_report.py            # CPU machine: no GPU needed
    .venv/bin/python bench/triton_compile_report.py --arch 80  # A100
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nystromformer.attention import nystrom_triton as nt  # noqa: E402

I64, I32 = "i64", "i32"


def strides(*names):
    return {n: I64 for n in names}


def configs(dt: str, prec: str, wide: bool):
    """(label, kernel, signature, constexprs, warps) as launched by nystrom_triton for dtype dt."""
    p = f"*{dt}"
    lq = dict(QL=p, K=p, **strides("skb", "skh", "skn", "skd"), V=p, **strides("svb", "svh", "svn", "svd"), BIAS=p)
    lk = dict(Q=p, **strides("sqb", "sqh", "sqn", "sqd"), KEEP=p, KL=p, ZW=p)
    dims = dict(H=I32, N=I32, M=I32, D=I32, scale="fp32")
    f64 = dict(IS_F64=False)
    yield ("pinv forward", nt._pinv_fwd_kernel, dict(A="*fp32", Z0="*fp32", Z="*fp32", m=I32),
           dict(ITERS=6, BLOCK=64, PREC=prec), nt.PINV_WARPS_64[prec][0])
    for transposed in (False, True):  # nt.PINV_BACKWARD_TRANSPOSED's two forms
        yield ("pinv backward" + (", transposed" if transposed else ""), nt._pinv_bwd_kernel,
               dict(A="*fp32", Z0="*fp32", G="*fp32", DA="*fp32", DZ0="*fp32", ZS="*fp32", m=I32),
               dict(ITERS=6, BLOCK=64, PREC=prec, TRANSPOSED=transposed), nt.PINV_WARPS_64[prec][1])
    for pair in (False, True):  # the one-node layer's Q and K in one launch
        yield ("segment means" + (", Q and K" if pair else ""), nt._segmeans_kernel,
               dict(X=p, **strides("sxb", "sxh", "sxn", "sxd"), X2=p, **strides("s2b", "s2h", "s2n", "s2d"), KEEP=p,
                    OUT=p, OUT2=p, H=I32, N=I32, M=I32, D=I32),
               dict(NCHUNK=1, BLOCK_N=8, BLOCK_D=64, IS_F64=False, HAS_X2=pair), 4)
    # the one-node layer reads the landmarks' two gradients (fp32) and adds them; for dQ at n ≤ 1,024 (bf16) the
    # second as pass 1's per-program partials (2 at n = 512)
    for one_node, parts in ((False, 1), (True, 1), (True, 2)):
        g = "*fp32" if one_node else p
        yield ("segment means backward" + (", two landmark gradients" if one_node else "")
               + (f", the second as {parts} partials" if parts > 1 else ""), nt._segmeans_bwd_kernel,
               dict(G=g, G2=g, s2bh=I32, s2p=I32, s2m=I32, KEEP=p, ADD=p, **strides("sab", "sah", "san", "sad"),
                    GX=p, **strides("sxb", "sxh", "sxn", "sxd"), H=I32, N=I32, M=I32, D=I32),
               dict(HAS_G2=one_node, G2_PARTS=parts, HAS_ADD=True, MASK_ADD=True, BLOCK_N=32, BLOCK_D=64,
                    IS_F64=False), 4)
    conv_args = dict(X=p, **strides("sxb", "sxh", "sxn", "sxd"), KEEP=p, W="*fp32", RES=p,
                     **strides("srb", "srh", "srn", "srd"), OUT=p, **strides("sob", "soh", "son", "sod"),
                     H=I32, N=I32, D=I32)
    for ks in (33, 65):  # both fit a 128-row window beside a 64-row tile
        yield (f"conv + residual, kernel {ks}", nt._dwconv_kernel, conv_args,
               dict(KS=ks, FLIP=False, IN_MASK=True, OUT_MASK=False, HAS_RES=True, BLOCK_N=64, WIN=128, BLOCK_D=64,
                    TILES=8, PREC=prec), 8)
        yield (f"conv input gradient (taps reversed) + pass 1's dV, kernel {ks}", nt._dwconv_kernel, conv_args,
               dict(KS=ks, FLIP=True, IN_MASK=False, OUT_MASK=True, HAS_RES=True, BLOCK_N=64, WIN=128, BLOCK_D=64,
                    TILES=8, PREC=prec), 8)
    yield ("conv weight gradient", nt._dwconv_wgrad_kernel,
           dict(X=p, **strides("sxb", "sxh", "sxn", "sxd"), KEEP=p, G=p, PART="*fp32", H=I32, N=I32, D=I32),
           dict(KS=33, BLOCK_N=64, BLOCK_D=64, IS_F64=False), 4)
    for ks in (33, 65):  # the paper's 33, the shipped configs' 65: the tiles as conv_weight_grad_mm chooses them
        rows, tiles = nt.wgrad_mm_tiles(4 if wide else 2, ks)
        block_t = nt._pow2(ks)
        yield (f"conv weight gradient (diagonals), kernel {ks}", nt._dwconv_wgrad_mm_kernel,
               dict(X=p, **strides("sxb", "sxh", "sxn", "sxd"), KEEP=p, G=p, **strides("sgb", "sgh", "sgn", "sgd"),
                    PART="*fp32", H=I32, N=I32, D=I32),
               dict(KS=ks, BLOCK_N=rows, WIN=nt._pow2(rows + block_t - 1), BLOCK_T=block_t, BLOCK_D=64,
                    TILES=tiles, PREC=prec, IS_F64=False), 8)
    for ks, win, block_t, win_t in ((33, 64, 64, 128), (65, 128, 128, 256)):  # the paper's 33, the configs' 65
        if wide:  # 16-bit inputs only (nt.CONV_BACKWARD_ONE_PASS_MAX_BYTES): fp32's tiles do not fit
            continue
        yield (f"conv backward in one pass (input + taps' gradients), kernel {ks}", nt._dwconv_bwd_kernel,
               dict(G=p, **strides("sgb", "sgh", "sgn", "sgd"), V=p, **strides("svb", "svh", "svn", "svd"), KEEP=p,
                    W="*fp32", DV=p, **strides("sdb", "sdh", "sdn", "sdd"), PART="*fp32", H=I32, N=I32, D=I32),
               dict(KS=ks, BLOCK_N=32, WIN=win, WIN_T=win_t, BLOCK_T=block_t, BLOCK_D=64, TILES=16, PREC=prec,
                    IS_F64=False), 8)
    # one program per (batch, head): it writes W itself, no combine launch; the one-node layer writes W once, in
    # fp32 (no copy in the inputs' dtype: HAS_LOW false)
    for finish, low in ((False, True), (True, True), (True, False)):
        yield ("pass 1 forward" + (", one program (writes W)" if finish else "") + ("" if low else ", fp32 W only"),
               nt._lq_fwd_kernel,
               dict(**lq, ACC="*fp32", MAX="*fp32", SUM="*fp32", OUT="*fp32", OUT_LOW=p, LSE="*fp32", **dims),
               dict(BLOCK_M=64, BLOCK_K=32 if wide else 64, BLOCK_D=64, TILES=8, PREC=prec, HAS_BIAS=True,
                    FINISH=finish, HAS_LOW=low, **f64), 8)
    for low in (True, False):
        yield ("pass 1 combine" + ("" if low else ", fp32 W only"), nt._lq_combine_kernel,
               dict(ACC="*fp32", MAX="*fp32", SUM="*fp32", OUT="*fp32", OUT_LOW=p, LSE="*fp32", M=I32, D=I32),
               dict(NPROG=128, BLOCK_M=64, BLOCK_D=64, ROWS=4, PARTS=16, HAS_LOW=low), 4)  # n = 65,536, bf16
    for one_node in (False, True):  # the one-node layer adds K's segment-means gradient into dK
        yield ("pass 1 backward" + (" + K's segment-means gradient" if one_node else ""), nt._lq_bwd_kernel,
               dict(**lq, DW=p, LSE="*fp32", WF="*fp32", DK=p, **strides("sgkb", "sgkh", "sgkn", "sgkd"), DV=p,
                    **strides("sgvb", "sgvh", "sgvn", "sgvd"), DQL_P="*fp32", KEEP=p, DKL="*fp32", DKL2="*fp32",
                    **dims),
               dict(BLOCK_M=64, BLOCK_K=16 if wide else 32, BLOCK_D=64, TILES=8, PREC=prec, HAS_BIAS=True,
                    HAS_SEG=one_node, **f64), 4 if wide else 8)
    core = dict(QL=p, KL=p)
    core_c = dict(BLOCK=64, BLOCK_D=64, OUTER="tf32x3", IS_F64=False)
    batch = dict(BLOCK_S=nt.CORE_BLOCK_S, CHUNKS=6)  # b·h = 1,536 (batch 128 × 12 heads)
    yield ("landmark core stats", nt._core_stats_kernel,
           dict(**core, COLS="*fp32", STAT="*fp32", M=I32, D=I32, scale="fp32"),
           dict(BLOCK=64, BLOCK_D=64, PREC="tf32x3", IS_F64=False), 4)
    # The iterating kernels in each form: landmark_core (Z·W, m × d, in the input dtype) or landmark_pinv (Z
    # alone, fp32 m × m: NYSTROM_OVERLAP=1); replaying the forward in the backward, or (≤ CORE_KEEP_MAX matrices)
    # reading the iterates the forward kept.
    # The one-node layer's core (the last form) reads W in fp32, its only copy, and rounds it to the inputs' dtype.
    for form, has_w, w_t in (("core", True, p), ("pinv", False, "*fp32"), ("core, W in fp32", True, "*fp32")):
        t = p if has_w else "*fp32"    # Z·W or Z, and their gradients
        for kept in (False, True):
            fwd, bwd = ((", keeping iterates", ", from kept iterates") if kept else ("", ""))
            yield (f"landmark {form} forward{fwd}", nt._core_fwd_kernel,
                   dict(**core, W=w_t, STAT="*fp32", ZW=t, ZS="*fp32", M=I32, D=I32, NBH=I32, GROUP=I32,
                        scale="fp32"),
                   dict(ITERS=6, **batch, PREC=prec, **core_c, HAS_W=has_w, KEEP=kept), nt.CORE_WARPS)
            for transposed in (False, True):
                yield (f"landmark {form} backward{bwd}" + (", transposed" if transposed else ""), nt._core_bwd_kernel,
                       dict(**core, W=w_t, STAT="*fp32", COLS="*fp32", G=t, DW=t, DA="*fp32", DDIV="*fp32",
                            NTIE="*fp32", ZS="*fp32", M=I32, D=I32, NBH=I32, GROUP=I32, scale="fp32"),
                       dict(ITERS=6, **batch, PREC=prec, **core_c, HAS_W=has_w, KEPT=kept, TRANSPOSED=transposed),
                       nt.CORE_WARPS)
    for one_node in (False, True):  # the one-node layer keeps the landmark gradients in fp32
        t = "*fp32" if one_node else p
        yield ("landmark core softmax backward" + (", fp32 landmark gradients" if one_node else ""),
               nt._core_softmax_bwd_kernel,
               dict(**core, DA="*fp32", STAT="*fp32", COLS="*fp32", DDIV="*fp32", NTIE="*fp32", DQL=t, DKL=t, M=I32,
                    D=I32, NBH=I32, GROUP=I32, scale="fp32"),
               dict(**batch, **core_c), nt.CORE_WARPS)
    for conv, ks in ((False, 1), (True, 33), (True, 65)):  # the one-node layer adds the conv inside pass 2's forward
        yield ("pass 2 forward" + (f" + conv {ks}" if conv else ""), nt._lk_fwd_kernel,
               dict(**lk, OUT=p, **strides("sob", "soh", "son", "sod"), V=p, **strides("svb", "svh", "svn", "svd"),
                    TAPS="*fp32", **dims),
               dict(BLOCK_N=64, BLOCK_M=64, BLOCK_D=64, PREC=prec, HAS_CONV=conv, KS=ks,
                    WIN=nt._pow2(64 + ks - 1)), 8)
    yield ("pass 2 backward", nt._lk_bwd_kernel,
           dict(**lk, DO=p, **strides("sdb", "sdh", "sdn", "sdd"), DQ=p, **strides("sgb", "sgh", "sgn", "sgd"),
                DKL_P="*fp32", DZW_P="*fp32", **dims),
           dict(BLOCK_N=32 if wide else 64, BLOCK_M=64, BLOCK_D=64, TILES=8, PREC=prec, **f64), 8)


def report(kernel, signature, constexprs, warps, arch):
    for name, value in constexprs.items():
        signature[name] = "constexpr"
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    target = re.search(r"^\.target\s+(\w+)", compiled.asm["ptx"], re.M).group(1)  # Triton emits sm_90a on Hopper
    out = subprocess.run([ptxas, f"-arch={target}", "-v", f.name, "-o", os.devnull], capture_output=True,
                         text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return compiled.metadata.shared, int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability ×10 (90 = H100/H200, 80 = A100)")
    args = ap.parse_args(argv)
    print(f"# Triton {triton.__version__} kernels compiled for sm_{args.arch} (head_dim 64, 64 landmarks, conv 33 and 65)")
    print("| kernel | dtype | warps | shared KB | registers | spill bytes |")
    print("|---|---|---|---|---|---|")
    for dt, prec, wide in (("bf16", "tf32", False), ("fp32", "tf32x3", True)):
        for label, kernel, sig, consts, warps in configs(dt, prec, wide):
            try:
                shared, regs, spill = report(kernel, dict(sig), dict(consts), warps, args.arch)
                print(f"| {label} | {dt} | {warps} | {shared / 1024:.1f} | {regs} | {spill} |")
            except Exception as exc:  # a configuration that does not compile is a finding, not a crash
                print(f"| {label} | {dt} | {warps} | failed: {type(exc).__name__}: {str(exc)[:80]} | | |")


if __name__ == "__main__":
    main()
