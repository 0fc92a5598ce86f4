"""How precise must the pseudo-inverse iteration's products be? Emulated on the CPU, no GPU needed.

The iteration (6 steps of 4 products on 64 × 64 matrices per batch·head) is the part of Nyström attention that the
n = 512 target cannot afford (docs/performance.md, "What is left", the n = 512 item). On Hopper a product with bf16 operands runs
at twice the tensor-core rate of tf32 — if the iteration tolerates bf16's 8-bit significand. This script rounds
the operands of every product of the landmark middle (kernel_2's scores, the iteration, Z·W) to tf32 (11 bits)
or bf16 (8 bits), accumulates in fp64, and compares Z and the attention output kernel_1 · Z · W with the fp64
computation, on landmarks of several scales (larger scores: a sharper, better conditioned kernel_2). For scale,
the last column is the error of rounding the exact output to bf16 once — what any bf16 attention output has.

A second table asks the same of the backward, which costs ~90 products per matrix against the forward's 24: could
it use the derivative of the exact inverse, dA = −Zᵀ·dZ·Zᵀ (2 products), instead of differentiating the 6 steps?
Only if the iteration has converged; the table compares the gradients of q and k through the attention output,
fp64, "implicit" against "unrolled" (the reference's autograd through the steps).

    python bench/pinv_precision.py            # ~5 s
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))

from nystromformer.attention.nystrom import iterative_pinv, pinv_init  # noqa: E402


def round_to(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x (fp64) with its significand rounded to ``bits`` bits (including the implicit one), nearest-even."""
    if bits >= 53:
        return x
    mantissa, exponent = torch.frexp(x)                       # x = mantissa · 2^exponent, |mantissa| in [0.5, 1)
    scaled = torch.round(mantissa * 2.0 ** bits)              # torch.round: half to even
    return torch.ldexp(scaled * 2.0 ** -bits, exponent)


def middle(q, k, q_land, k_land, v, bits: int, iters: int = 6, exact_last: int = 0, last_bits: int = 11):
    """Z = pinv(kernel_2) by the paper's iteration and the output kernel_1 · Z · (kernel_3 · V), every product's
    operands rounded to ``bits`` — but those of the last ``exact_last`` steps and of Z·W to ``last_bits``;
    softmaxes and sums in fp64 (the kernels keep those in fp32)."""
    precision = [bits]

    def mm(a, b):
        return round_to(a, precision[0]) @ round_to(b, precision[0])
    scale = q.shape[-1] ** -0.5
    kernel_1 = torch.softmax(q @ k_land.transpose(-1, -2) * scale, dim=-1)     # the passes: SDPA, not emulated
    kernel_3 = torch.softmax(q_land @ k.transpose(-1, -2) * scale, dim=-1)
    w = kernel_3 @ v
    kernel_2 = torch.softmax(mm(q_land, k_land.transpose(-1, -2)) * scale, dim=-1)
    z = pinv_init(kernel_2, "original")
    eye = torch.eye(kernel_2.shape[-1], dtype=kernel_2.dtype)
    for step in range(iters):
        if step == iters - exact_last:
            precision[0] = last_bits
        kz = mm(kernel_2, z)
        z = mm(0.25 * z, 13 * eye - mm(kz, 15 * eye - mm(kz, 7 * eye - kz)))
    if exact_last:
        precision[0] = last_bits
    return z, kernel_1 @ mm(z, w)


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


class ImplicitPinv(torch.autograd.Function):
    """The iteration forward; backward as if Z were the exact inverse of A: dA = −Zᵀ dZ Zᵀ."""

    @staticmethod
    def forward(ctx, a, iters):
        z = iterative_pinv(a, iters)
        ctx.save_for_backward(z)
        return z

    @staticmethod
    def backward(ctx, grad_z):
        z_t = ctx.saved_tensors[0].transpose(-1, -2)
        return -z_t @ grad_z @ z_t, None


def attention_gradients(q, k, v, grad_out, m: int, iters: int, implicit: bool):
    """Gradients of q, k through the reference's Nyström output (no conv), fp64, all matrices one batch."""
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    scale = q.shape[-1] ** -0.25
    qs, ks = q * scale, k * scale
    n = q.shape[-2]
    q_land = qs.reshape(*qs.shape[:-2], m, n // m, qs.shape[-1]).mean(-2)
    k_land = ks.reshape(*ks.shape[:-2], m, n // m, ks.shape[-1]).mean(-2)
    kernel_1 = torch.softmax(qs @ k_land.transpose(-1, -2), dim=-1)
    kernel_2 = torch.softmax(q_land @ k_land.transpose(-1, -2), dim=-1)
    kernel_3 = torch.softmax(q_land @ ks.transpose(-1, -2), dim=-1)
    z = ImplicitPinv.apply(kernel_2, iters) if implicit else iterative_pinv(kernel_2, iters)
    out = kernel_1 @ z @ (kernel_3 @ v)
    return torch.autograd.grad(out, (q, k), grad_out), kernel_2.detach(), z.detach()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--landmarks", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch-heads", type=int, default=24)
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--gradient-steps", type=int, nargs="+", default=[6, 30],
                    help="iteration counts for the backward table (the paper: 6; 30: converged, where both must agree)")
    args = ap.parse_args(argv)
    n, m, d = args.n, args.landmarks, args.head_dim
    print(f"# landmark middle, relative error against fp64: n={n}, {m} landmarks, head_dim {d}, "
          f"{args.batch_heads} matrices, 6 iterations, init 'original'")
    print("| q, k scale | kernel_2 condition (median) | Z: tf32 | Z: bf16 | Z: bf16, last 2 steps tf32 "
          "| output: tf32 | output: bf16 | output: bf16, last 2 steps tf32 | output rounded to bf16 once |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in args.scales:
        g = torch.Generator().manual_seed(int(s * 1000))
        q, k, v = (torch.randn(args.batch_heads, n, d, generator=g, dtype=torch.float64) for _ in range(3))
        q, k = q * s, k * s
        # segment means as the model's landmarks (n divisible by m here)
        q_land = q.reshape(args.batch_heads, m, n // m, d).mean(-2)
        k_land = k.reshape(args.batch_heads, m, n // m, d).mean(-2)
        z64, out64 = middle(q, k, q_land, k_land, v, 53)
        z_tf32, out_tf32 = middle(q, k, q_land, k_land, v, 11)
        z_bf16, out_bf16 = middle(q, k, q_land, k_land, v, 8)
        z_mix, out_mix = middle(q, k, q_land, k_land, v, 8, exact_last=2)
        kernel_2 = torch.softmax(q_land @ k_land.transpose(-1, -2) * d ** -0.5, dim=-1)
        cond = torch.linalg.cond(kernel_2).median().item()
        print(f"| {s:g} | {cond:.3g} | {rel(z_tf32, z64):.1e} | {rel(z_bf16, z64):.1e} | {rel(z_mix, z64):.1e} "
              f"| {rel(out_tf32, out64):.1e} | {rel(out_bf16, out64):.1e} | {rel(out_mix, out64):.1e} "
              f"| {rel(round_to(out64, 8), out64):.1e} |")

    print()
    print(f"# backward: derivative of the exact inverse (-Zᵀ dZ Zᵀ) against differentiating the steps, relative "
          f"error of the q, k gradients, fp64, {args.batch_heads} matrices")
    print("| q, k scale | steps | kernel_2 condition (median) | ‖ZA − I‖ / ‖I‖ | dq | dk |")
    print("|---|---|---|---|---|---|")
    for s in args.scales:
        for iters in args.gradient_steps:
            g = torch.Generator().manual_seed(int(s * 1000) + 1)
            q, k, v, grad_out = (torch.randn(1, args.batch_heads, n, d, generator=g, dtype=torch.float64)
                                 for _ in range(4))
            (dq, dk), a, z = attention_gradients(q * s, k * s, v, grad_out, m, iters, implicit=False)
            (dq_i, dk_i), _, _ = attention_gradients(q * s, k * s, v, grad_out, m, iters, implicit=True)
            cond = torch.linalg.cond(a).median().item()
            unconverged = rel(z @ a, torch.eye(m, dtype=a.dtype))
            print(f"| {s:g} | {iters} | {cond:.3g} | {unconverged:.1e} | {rel(dq_i, dq):.1e} | {rel(dk_i, dk):.1e} |")


if __name__ == "__main__":
    main()
