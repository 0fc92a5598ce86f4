"""Triton kernels for the fast Nyström path (``nystrom_fast``), each with its autograd rule.

* ``pinv_iterate(a, z0, iters)``: the paper's pseudo-inverse iteration, one program per (batch, head) matrix doing
  every step in registers (m ≤ 64, padded to a power of two ≥ 16; larger m goes to the PyTorch iteration). The
  init Z₀ is computed outside in PyTorch (``nystrom.pinv_init``) because ``init="original"`` needs a max over the
  whole batch (a global reduction before the per-matrix kernel), and so that its gradient is autograd's.
  Backward: one program per matrix replays the forward once, keeping each step's input iterate in a transient
  scratch slice of its own (iters·m² floats), then walks the steps in reverse. The products' precision is
  Triton's ``input_precision``: "ieee" (true fp32 FMA), "tf32x3" (three tensor-core passes, near fp32) or
  "tf32" (one pass, ~1e-3: enough when the attention itself runs in bf16). The first H100 run (one program of
  4 warps per 64×64 matrix, the backward recomputing every iterate from Z₀) spilled 33 KB of registers per
  thread and took 19.5 + 14.9 ms for 1,536 matrices: warps, precision and the scratch replay come from that.
* ``landmark_core(q_land, k_land, w, iters)`` (``NYSTROM_TRITON=all``, ``init="original"``): everything between
  the two attention passes — kernel_2's softmax, the batch-wide init, the iteration, Z·W — in 2 launches forward
  (column sums; then per matrix: the batch max read from every matrix's stat, Z₀, the steps, Z·W) and 2 backward
  (Z·W's and the iteration's backward; then the batch max's gradient split over tied column sums, the softmax's
  and Q̃K̃ᵀ's backward), replacing ~30 PyTorch operators per layer.
* ``segment_means_masked(x, keep, m)``: means of ``x·keep`` over the reference's m segments (floor(p·m/n) = i),
  fp32 accumulation, fusing the padding multiply. Backward: one kernel writing keep·g[segment]/length.
* ``conv_add(v, keep, w, res)``: ``res + Conv2d_{(k,1), groups=h}(v·keep)`` (the reference's depthwise conv along
  the sequence, shared over the head dim) in one pass, fusing the mask and the residual add; each tile of 64
  rows is a banded-Toeplitz matrix product on the tensor cores (the first version's 33 shifted loads per row
  ran at ~3× the bandwidth floor on the H100); backward: the input gradient is the same kernel with flipped
  taps (and the mask on the output), the weight gradient a per-block partial reduction summed in PyTorch.

Every kernel takes arbitrary strides for its big (b, h, n, d) inputs: the model's q, k, v are transposed views.
Tested against the PyTorch reference under ``TRITON_INTERPRET=1`` on CPU (``tests/test_nystrom_fast.py``).
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from typing import Optional

import torch

from . import nystrom_fast
# The kernels' limits live beside the dispatch that checks them (which must not import triton to read them)
from .nystrom_fast import MAX_HEAD_DIM, MAX_LANDMARKS  # noqa: F401  (also read as nystrom_triton.MAX_*)

try:  # triton is an optional dependency (the `test` extra installs it; CUDA images ship it with torch)
    import triton
    import triton.language as tl
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None


# The largest block of shared memory the kernels ask for at head_dim ≤ 64, by the attention's element size
# (bench/triton_compile_report.py, sm_90): 16-bit 160 KB (the pinv backward), fp32 193 KB (the conv's tf32x3
# product). An H100 (227 KB per block) has both; an A100 (163 KB) the first; sm_86/89 cards (99 KB) neither —
# there the fast path runs on PyTorch ops instead.
SHARED_MEMORY_NEEDED = {2: 163840, 4: 197632, 8: 197632}


# The kernels were written and checked (CPU interpreter, sm_90 compiles, the H100 tests) with Triton 3.6; older
# releases lack language features they use (tl.gather). With an older Triton — e.g. a CUDA image whose torch
# ships one — the fast path runs on PyTorch ops instead, with a warning, rather than failing mid-training.
MIN_TRITON = (3, 6)


@torch.compiler.assume_constant_result  # as fits_device: not traced (dynamo warns about the lru_cache inside)
def available() -> bool:
    return triton is not None and _recent_enough(triton.__version__)


@functools.lru_cache(maxsize=None)
def _recent_enough(version: str) -> bool:
    try:
        ok = tuple(int(part) for part in version.split(".")[:2]) >= MIN_TRITON
    except ValueError:  # a development build's version string: let it try
        return True
    if not ok:
        warnings.warn(f"Nyström attention: Triton {version} is older than the {'.'.join(map(str, MIN_TRITON))} its "
                      f"kernels need; using PyTorch ops instead (slower, same results)", stacklevel=3)
    return ok


@torch.compiler.assume_constant_result  # torch.compile: evaluated once while tracing, not traced into
def fits_device(index: Optional[int], element_size: int = 2) -> bool:
    """Whether CUDA device ``index`` (None: the current one) gives a block the shared memory the kernels need
    for attention inputs of ``element_size`` bytes (unknown: assume it does)."""
    return _fits_device(torch.cuda.current_device() if index is None else index, element_size)


@functools.lru_cache(maxsize=None)
def _fits_device(index: int, element_size: int) -> bool:
    need = SHARED_MEMORY_NEEDED[element_size]
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(index)
    except Exception:  # pragma: no cover - depends on the driver API of the installed triton
        return True
    return props.get("max_shared_mem", need) >= need


# Host-side integer helpers. Triton 3.6's triton.cdiv / triton.next_power_of_2 are constexpr functions whose
# every host call unwraps its arguments (~2 µs each, about 50 a layer's forward + backward): plain Python here.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two ≥ n (n ≥ 1)."""
    return 1 << (n - 1).bit_length()


# Launch settings of the n-long passes' wrappers: each chooses its own below (rows a tile, tiles a program, warps —
# by ptxas's spills and the H100 runs). A file named by NYSTROM_LAUNCH_SETTINGS replaces any of them by the
# inputs' dtype and the wrapper's name (nystrom_fast.launch_settings; bench/kernel_settings.py --best writes one),
# and a benchmark's LAUNCH_OVERRIDES["conv_raw"] = {"rows": 32, "num_stages": 2} replaces both, for every dtype
# (bench/kernel_settings.py sweeps them).
LAUNCH_OVERRIDES: dict = {}


def _launch(wrapper: str, dtype: torch.dtype, **chosen) -> dict:
    """The wrapper's ``chosen`` settings for inputs of ``dtype``, with those of the NYSTROM_LAUNCH_SETTINGS file for
    that dtype and then those of ``LAUNCH_OVERRIDES[wrapper]`` in their place (also ``num_stages``, which is
    otherwise Triton's default)."""
    from_file = (nystrom_fast.launch_settings().get(nystrom_fast.DTYPE_NAMES.get(dtype), {}).get(wrapper)
                 if "NYSTROM_LAUNCH_SETTINGS" in os.environ else None)
    if from_file and "when" in from_file:
        from_file = _swept_here(wrapper, dtype, from_file, chosen)
    override = LAUNCH_OVERRIDES.get(wrapper)
    if not override and not from_file:
        return chosen
    unknown = set(override or ()) - set(chosen) - {"num_stages"}
    if unknown:
        raise ValueError(f"LAUNCH_OVERRIDES[{wrapper!r}]: no setting {sorted(unknown)}; it has {sorted(chosen)} "
                         f"and num_stages")
    return {**chosen, **(from_file or {}), **(override or {})}


def _swept_here(wrapper: str, dtype: torch.dtype, entry: dict, chosen: dict) -> Optional[dict]:
    """A settings file's entry without its ``"when"``, if the wrapper chose here what it chose where the entry was
    swept; else None: a setting timed against other own settings (another conv width, another dtype size) was
    never measured here and may not fit the shared memory."""
    when = entry["when"]
    if all(chosen.get(key) == value for key, value in when.items()):
        return {key: value for key, value in entry.items() if key != "when"}
    key = (wrapper, dtype, id(entry), tuple(chosen.items()))  # the file is read once: its entries stay
    if key not in _NOT_SWEPT_HERE:  # warned once; every later launch skips the message's formatting
        _NOT_SWEPT_HERE.add(key)
        warnings.warn(f"NYSTROM_LAUNCH_SETTINGS: {wrapper} ({dtype}) was swept where it chose "
                      f"{json.dumps(when, sort_keys=True)}; here it chooses {json.dumps(chosen, sort_keys=True)}: "
                      f"the file's setting is not used for these inputs", stacklevel=3)
    return None


_NOT_SWEPT_HERE: set = set()


def _warps(settings: dict) -> dict:
    """The launch keywords of ``_launch``'s settings: num_warps, and num_stages when one is set."""
    return {k: settings[k] for k in ("num_warps", "num_stages") if k in settings}


def _block(m: int) -> int:
    """A tile side for m rows or columns: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, _pow2(m))


if triton is not None:

    @triton.jit
    def _pinv_step(a, z, eye, PREC: tl.constexpr):
        p = tl.dot(a, z, input_precision=PREC)
        s1 = tl.dot(p, 7.0 * eye - p, input_precision=PREC)
        s2 = tl.dot(p, 15.0 * eye - s1, input_precision=PREC)
        return 0.25 * tl.dot(z, 13.0 * eye - s2, input_precision=PREC)

    @triton.jit
    def _pinv_operands(A, Z0, m, BLOCK: tl.constexpr):
        # This program's matrix A, initial iterate Z₀ and identity, zero-padded to BLOCK², and their offsets.
        pid = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK)
        inside = (r[:, None] < m) & (r[None, :] < m)
        off = pid * m * m + r[:, None] * m + r[None, :]
        a = tl.load(A + off, mask=inside, other=0.0)
        z = tl.load(Z0 + off, mask=inside, other=0.0)
        eye = tl.where((r[:, None] == r[None, :]) & inside, 1.0, 0.0).to(a.dtype)
        return pid, off, inside, a, z, eye

    @triton.jit
    def _pinv_fwd_kernel(A, Z0, Z, m, ITERS: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr):
        pid, off, inside, a, z, eye = _pinv_operands(A, Z0, m, BLOCK)
        for _ in range(ITERS):
            z = _pinv_step(a, z, eye, PREC)
        tl.store(Z + off, z, mask=inside)

    @triton.jit
    def _pinv_replay(a, z, eye, zs, ITERS: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr):
        # The forward once more from z = Z₀, keeping the iterate that enters each step in this program's scratch
        # slice zs (ITERS blocks of BLOCK²); returns the final iterate.
        for i in range(ITERS):
            tl.store(zs + i * BLOCK * BLOCK, z)
            z = _pinv_step(a, z, eye, PREC)
        tl.debug_barrier()  # the scratch was written by other threads of this program
        return z

    @triton.jit
    def _pinv_step_parts(a, zs, step, eye, BLOCK: tl.constexpr, PREC: tl.constexpr):
        # Step `step`'s input iterate Z (from _pinv_replay's scratch) and the forward's intermediates:
        # P = AZ, T1 = 7I - P, S1 = P T1, T2 = 15I - S1, S2 = P T2, T3 = 13I - S2 (the step's output is Z T3 / 4)
        z = tl.load(zs + step * BLOCK * BLOCK)
        p = tl.dot(a, z, input_precision=PREC)
        t1 = 7.0 * eye - p
        t2 = 15.0 * eye - tl.dot(p, t1, input_precision=PREC)
        t3 = 13.0 * eye - tl.dot(p, t2, input_precision=PREC)
        return z, p, t1, t2, t3

    @triton.jit
    def _pinv_reverse(a, g, eye, zs, ITERS: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr):
        # Back through the steps (their input iterates in zs, from _pinv_replay) with g = dL/dZ_final:
        # returns (dL/dA through the iteration, dL/dZ₀).
        da = tl.zeros_like(a)
        for s in range(ITERS):
            z, p, t1, t2, t3 = _pinv_step_parts(a, zs, ITERS - 1 - s, eye, BLOCK, PREC)
            pt = tl.trans(p)
            zt = tl.trans(z)
            dz = 0.25 * tl.dot(g, tl.trans(t3), input_precision=PREC)
            ds2 = -0.25 * tl.dot(zt, g, input_precision=PREC)
            dp = tl.dot(ds2, tl.trans(t2), input_precision=PREC)
            ds1 = -tl.dot(pt, ds2, input_precision=PREC)
            dp += tl.dot(ds1, tl.trans(t1), input_precision=PREC)
            dp -= tl.dot(pt, ds1, input_precision=PREC)
            da += tl.dot(dp, zt, input_precision=PREC)
            g = dz + tl.dot(tl.trans(a), dp, input_precision=PREC)
        return da, g

    @triton.jit
    def _pinv_reverse_transposed(a, h, eye, zs, ITERS: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr):
        # _pinv_reverse with every gradient transposed: h = (dL/dZ_final)ᵀ in, ((dL/dA)ᵀ, (dL/dZ₀)ᵀ) out — the
        # same products, each computed as its transpose (XY)ᵀ = YᵀXᵀ. Why: tf32 wgmma reads K-major operands only,
        # so a matrix used in both orientations is staged in shared memory twice; in this form P, T1, T2 and the
        # gradients are never transposed, and h enters its one left-hand use as a value computed in registers
        # (-0.25·h), not staged. Shared memory at 64 × 64, tf32, 4 warps (ptxas, sm_90): 112 KB instead of 160,
        # so two programs fit on an SM (228 KB) instead of one.
        da_t = tl.zeros_like(a)
        for s in range(ITERS):
            z, p, t1, t2, t3 = _pinv_step_parts(a, zs, ITERS - 1 - s, eye, BLOCK, PREC)
            dz_t = 0.25 * tl.dot(t3, h, input_precision=PREC)                 # (¼ G T3ᵀ)ᵀ
            ds2_t = tl.dot(-0.25 * h, z, input_precision=PREC)                # (−¼ Zᵀ G)ᵀ
            dp_t = tl.dot(t2, ds2_t, input_precision=PREC)                    # (dS2 T2ᵀ)ᵀ
            ds1_t = -tl.dot(ds2_t, p, input_precision=PREC)                   # (−Pᵀ dS2)ᵀ
            dp_t += tl.dot(t1, ds1_t, input_precision=PREC)                   # (dS1 T1ᵀ)ᵀ
            dp_t -= tl.dot(ds1_t, p, input_precision=PREC)                    # (Pᵀ dS1)ᵀ
            da_t += tl.dot(z, dp_t, input_precision=PREC)                     # (dP Zᵀ)ᵀ
            h = dz_t + tl.dot(dp_t, a, input_precision=PREC)                  # (dZ + Aᵀ dP)ᵀ
        return da_t, h

    @triton.jit
    def _pinv_bwd_kernel(A, Z0, G, DA, DZ0, ZS, m, ITERS: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr,
                         TRANSPOSED: tl.constexpr):
        pid, off, inside, a, z, eye = _pinv_operands(A, Z0, m, BLOCK)
        r = tl.arange(0, BLOCK)
        zs = ZS + pid * ITERS * BLOCK * BLOCK + r[:, None] * BLOCK + r[None, :]
        _pinv_replay(a, z, eye, zs, ITERS, BLOCK, PREC)
        if TRANSPOSED:  # loads and stores through transposed offsets: no transposed copy of G, DA or DZ0
            off_t = pid * m * m + r[None, :] * m + r[:, None]
            h = tl.load(G + off_t, mask=inside, other=0.0).to(a.dtype)
            da_t, h = _pinv_reverse_transposed(a, h, eye, zs, ITERS, BLOCK, PREC)
            tl.store(DA + off_t, da_t, mask=inside)
            tl.store(DZ0 + off_t, h, mask=inside)
        else:
            g = tl.load(G + off, mask=inside, other=0.0).to(a.dtype)
            da, g = _pinv_reverse(a, g, eye, zs, ITERS, BLOCK, PREC)
            tl.store(DA + off, da, mask=inside)
            tl.store(DZ0 + off, g, mask=inside)

    @triton.jit
    def _taps_grad_tile(G, sgn, sgd, X, sxn, sxd, KEEP, b, N, D, row0, pad, cols, BLOCK_N: tl.constexpr,
                        WIN: tl.constexpr, BLOCK_T: tl.constexpr, PREC: tl.constexpr):
        # One tile of BLOCK_N rows' share of the taps' gradient, (BLOCK_T,): the product M = G_tile ·
        # (keep·X)_windowᵀ (BLOCK_N × WIN, the window from row0 - pad) on the tensor cores, then tap t's sum is
        # the sum of M's t-th diagonal, M[i, i + t], gathered. G, X: this (batch, head)'s base pointers.
        rows = row0 + tl.arange(0, BLOCK_N)
        g = tl.load(G + rows[:, None].to(tl.int64) * sgn + cols[None, :] * sgd,
                    mask=(rows[:, None] < N) & (cols[None, :] < D), other=0.0)
        x = _conv_window(X, sxn, sxd, KEEP, b, N, D, row0 - pad + tl.arange(0, WIN), cols, True)
        m = tl.dot(g, tl.trans(x.to(g.dtype)), input_precision=PREC)
        diagonal = tl.arange(0, BLOCK_N)[:, None] + tl.arange(0, BLOCK_T)[None, :]
        return tl.sum(tl.gather(m, diagonal, axis=1), axis=0)

    @triton.jit
    def _dwconv_wgrad_mm_kernel(X, sxb, sxh, sxn, sxd, KEEP, G, sgb, sgh, sgn, sgd, PART, H, N, D, KS: tl.constexpr,
                                BLOCK_N: tl.constexpr, WIN: tl.constexpr, BLOCK_T: tl.constexpr,
                                BLOCK_D: tl.constexpr, TILES: tl.constexpr, PREC: tl.constexpr,
                                IS_F64: tl.constexpr):
        # PART[bh, prog, t] = sum over TILES row tiles of sum_i G[i,:] · keep[i+t-KS//2] X[i+t-KS//2,:], a product
        # and a diagonal gather per tile (_taps_grad_tile) instead of KS shifted loads and reductions.
        bh, b, h = _batch_head(H)
        cols = tl.arange(0, BLOCK_D)
        if IS_F64:
            acc = tl.zeros([BLOCK_T], dtype=tl.float64)
        else:
            acc = tl.zeros([BLOCK_T], dtype=tl.float32)
        for tile in range(TILES):
            row0 = (tl.program_id(1) * TILES + tile) * BLOCK_N
            acc += _taps_grad_tile(G + b * sgb + h * sgh, sgn, sgd, X + b * sxb + h * sxh, sxn, sxd, KEEP, b, N, D,
                                   row0, KS // 2, cols, BLOCK_N, WIN, BLOCK_T, PREC).to(acc.dtype)
        tl.store(PART + (bh.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * BLOCK_T
                 + tl.arange(0, BLOCK_T), acc)

    @triton.jit
    def _dwconv_bwd_kernel(G, sgb, sgh, sgn, sgd, V, svb, svh, svn, svd, KEEP, W, DV, sdb, sdh, sdn, sdd, PART, H, N,
                           D, KS: tl.constexpr, BLOCK_N: tl.constexpr, WIN: tl.constexpr, WIN_T: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr, PREC: tl.constexpr,
                           IS_F64: tl.constexpr):
        # The conv's whole backward in one pass over its row tiles (the one-node layer), each of G, V and DV read
        # once instead of G twice and V, DV once by two kernels:
        #   DV[i] += keep[i] · sum_t W[h, t] · G[i - t + KS//2]     (the input gradient: _dwconv_kernel, FLIP)
        #   PART[bh, prog, t] = sum_i G[i] · keep[i+t-KS//2] V[i+t-KS//2]  (the taps': _dwconv_wgrad_mm_kernel)
        # Each half is its kernel's tile body; the input gradient's window covers BLOCK_N + KS - 1 rows (WIN), the
        # taps' BLOCK_N + BLOCK_T - 1 (WIN_T).
        bh, b, h = _batch_head(H)
        pad = KS // 2
        band = _conv_band(W, h, KS, True, BLOCK_N, WIN, G.dtype.element_ty)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols[None, :] < D
        if IS_F64:
            acc = tl.zeros([BLOCK_T], dtype=tl.float64)
        else:
            acc = tl.zeros([BLOCK_T], dtype=tl.float32)
        g_base = G + b * sgb + h * sgh
        for tile in range(TILES):
            row0 = (tl.program_id(1) * TILES + tile) * BLOCK_N
            rows = row0 + tl.arange(0, BLOCK_N)
            rmask = rows < N
            window = _conv_window(g_base, sgn, sgd, KEEP, b, N, D, row0 - pad + tl.arange(0, WIN), cols, False)
            dv = tl.dot(band, window, input_precision=PREC)
            dv = dv * tl.load(KEEP + b * N + rows, mask=rmask, other=0.0).to(dv.dtype)[:, None]
            at = DV + b * sdb + h * sdh + rows[:, None].to(tl.int64) * sdn + cols[None, :] * sdd
            dv += tl.load(at, mask=rmask[:, None] & cmask, other=0.0).to(dv.dtype)
            tl.store(at, dv, mask=rmask[:, None] & cmask)
            acc += _taps_grad_tile(g_base, sgn, sgd, V + b * svb + h * svh, svn, svd, KEEP, b, N, D, row0, pad, cols,
                                   BLOCK_N, WIN_T, BLOCK_T, PREC).to(acc.dtype)
        tl.store(PART + (bh.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * BLOCK_T
                 + tl.arange(0, BLOCK_T), acc)

    @triton.jit
    def _batch_head(H):
        # The program's (batch·head) row and its batch and head indices (64-bit: they scale big offsets).
        bh = tl.program_id(0)
        return bh, (bh // H).to(tl.int64), (bh % H).to(tl.int64)

    @triton.jit
    def _store_partial(PTR, tile, bh, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        # This program's (BLOCK_M, BLOCK_D) partial sum, at [bh, program_id(1)] of a (b·h, programs, BLOCK_M,
        # BLOCK_D) buffer that PyTorch sums over programs.
        part = bh.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        tl.store(PTR + (part * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :],
                 tile)

    @triton.jit
    def _landmark_tile(PTR, bh, M, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        # The (BLOCK_M, BLOCK_D) tile of row bh of a contiguous (b·h, M, D) tensor, zero beyond M and D.
        lm = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        return tl.load(PTR + (bh.to(tl.int64) * M + lm[:, None]) * D + cols[None, :],
                       mask=(lm[:, None] < M) & (cols[None, :] < D), other=0.0)

    @triton.jit
    def _accumulator(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, IS_F64: tl.constexpr):
        if IS_F64:
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float64)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        return acc

    # --- the landmark core: ZW = pinv(softmax(Q̃ K̃ᵀ · scale)) · W, one program per (batch, head) matrix -------
    # init="original" scales Z₀ by the max column sum over the *whole batch* (or over each group of GROUP matrices:
    # init_rows), a global reduction between the softmax and the iteration; so: _core_stats_kernel (softmax, column
    # sums) → _core_fwd_kernel (each program reads its group's maxes, ≤ b·h floats, then iterates in registers).
    # Backward: _core_bwd_kernel (ZW and pinv backward, each matrix's share of the max's gradient) →
    # _core_softmax_bwd_kernel (the max's gradient, split evenly over the group's tied column sums as torch.max's
    # backward does, then softmax and Q̃K̃ᵀ backward). The m × m softmax is recomputed rather than stored: one
    # 64×64×64 product.
    @triton.jit
    def _to_work(x, IS_F64: tl.constexpr):
        if IS_F64:
            y = x.to(tl.float64)
        else:
            y = x.to(tl.float32)
        return y

    @triton.jit
    def _store_landmark_tile(PTR, bh, tile, M, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        lm = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        tl.store(PTR + (bh.to(tl.int64) * M + lm[:, None]) * D + cols[None, :], tile.to(PTR.dtype.element_ty),
                 mask=(lm[:, None] < M) & (cols[None, :] < D))

    @triton.jit
    def _kernel_2(QL, KL, bh, M, D, scale, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                  IS_F64: tl.constexpr):
        # softmax(Q̃ K̃ᵀ · scale) of matrix bh in the work dtype; zero outside m × m
        q = _to_work(_landmark_tile(QL, bh, M, D, BLOCK, BLOCK_D), IS_F64)
        k = _to_work(_landmark_tile(KL, bh, M, D, BLOCK, BLOCK_D), IS_F64)
        r = tl.arange(0, BLOCK)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where((r < M)[None, :], s, float("-inf"))
        e = tl.exp(s - tl.max(s, axis=1)[:, None])
        return tl.where((r < M)[:, None], e / tl.sum(e, axis=1)[:, None], 0.0)

    @triton.jit
    def _batch_max(X, NBH, BLOCK_S: tl.constexpr, CHUNKS: tl.constexpr):
        # max of X[0:NBH] (CHUNKS = ⌈NBH / BLOCK_S⌉): every program reads the same b·h floats (a few KB, from L2)
        idx = tl.arange(0, BLOCK_S)
        best = tl.load(X + idx, mask=idx < NBH, other=float("-inf"))
        for c in range(1, CHUNKS):
            best = tl.maximum(best, tl.load(X + c * BLOCK_S + idx, mask=c * BLOCK_S + idx < NBH,
                                            other=float("-inf")))
        return tl.max(best, axis=0)

    @triton.jit
    def _batch_sum(X, NBH, BLOCK_S: tl.constexpr, CHUNKS: tl.constexpr):
        idx = tl.arange(0, BLOCK_S)
        total = tl.load(X + idx, mask=idx < NBH, other=0.0)
        for c in range(1, CHUNKS):
            total += tl.load(X + c * BLOCK_S + idx, mask=c * BLOCK_S + idx < NBH, other=0.0)
        return tl.sum(total, axis=0)

    @triton.jit
    def _group_max(X, bh, NBH, GROUP, BLOCK_S: tl.constexpr, CHUNKS: tl.constexpr):
        # the max over matrix bh's group: GROUP consecutive matrices (init_rows batch rows; the last group may be
        # shorter), every matrix of the batch when GROUP = NBH (CHUNKS = ⌈GROUP / BLOCK_S⌉)
        base = (bh // GROUP) * GROUP
        return _batch_max(X + base, tl.minimum(GROUP, NBH - base), BLOCK_S, CHUNKS)

    @triton.jit
    def _group_sum(X, bh, NBH, GROUP, BLOCK_S: tl.constexpr, CHUNKS: tl.constexpr):
        base = (bh // GROUP) * GROUP
        return _batch_sum(X + base, tl.minimum(GROUP, NBH - base), BLOCK_S, CHUNKS)

    @triton.jit
    def _core_stats_kernel(QL, KL, COLS, STAT, M, D, scale, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                           PREC: tl.constexpr, IS_F64: tl.constexpr):
        # COLS[bh] = the column sums of kernel_2, STAT[bh] = their max (the batch max is the max of STAT)
        bh = tl.program_id(0)
        r = tl.arange(0, BLOCK)
        colsum = tl.sum(_kernel_2(QL, KL, bh, M, D, scale, BLOCK, BLOCK_D, PREC, IS_F64), axis=0)
        tl.store(COLS + bh.to(tl.int64) * M + r, colsum, mask=r < M)
        tl.store(STAT + bh, tl.max(tl.where(r < M, colsum, float("-inf")), axis=0))

    @triton.jit
    def _core_fwd_kernel(QL, KL, W, STAT, ZW, ZS, M, D, NBH, GROUP, scale, ITERS: tl.constexpr, BLOCK: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNKS: tl.constexpr, PREC: tl.constexpr,
                         OUTER: tl.constexpr, IS_F64: tl.constexpr, HAS_W: tl.constexpr, KEEP: tl.constexpr):
        # HAS_W: ZW = Z·W (m × d), W rounded to ZW's dtype first (a no-op where they match, as in landmark_core;
        # the one-node layer passes its only copy of W, in fp32, for a Z·W in the inputs' dtype; the backward
        # rounds it to G's, Z·W's, likewise); otherwise Z itself (m × m, W unused), for Z·W computed later — the
        # split form that lets the iteration run on a second stream while pass 1 computes W. KEEP: the iterate
        # entering each step goes to ZS, so the backward need not replay the forward (few matrices: its latency is
        # the cost).
        bh = tl.program_id(0)
        r = tl.arange(0, BLOCK)
        a = _kernel_2(QL, KL, bh, M, D, scale, BLOCK, BLOCK_D, OUTER, IS_F64)
        z = tl.trans(a) / _group_max(STAT, bh, NBH, GROUP, BLOCK_S, CHUNKS)  # Z₀ = Aᵀ / max column sum
        eye = tl.where((r[:, None] == r[None, :]) & (r < M)[:, None], 1.0, 0.0).to(a.dtype)
        if KEEP:  # ZS: ITERS + 1 blocks per matrix, the last for the final Z (dW needs it)
            zs = ZS + bh.to(tl.int64) * (ITERS + 1) * BLOCK * BLOCK + r[:, None] * BLOCK + r[None, :]
            z = _pinv_replay(a, z, eye, zs, ITERS, BLOCK, PREC)
            tl.store(zs + ITERS * BLOCK * BLOCK, z)
        else:
            for _ in range(ITERS):
                z = _pinv_step(a, z, eye, PREC)
        if HAS_W:
            w = _to_work(_landmark_tile(W, bh, M, D, BLOCK, BLOCK_D).to(ZW.dtype.element_ty), IS_F64)
            _store_landmark_tile(ZW, bh, tl.dot(z, w, input_precision=OUTER), M, D, BLOCK, BLOCK_D)
        else:
            _store_landmark_tile(ZW, bh, z, M, M, BLOCK, BLOCK)

    @triton.jit
    def _core_bwd_kernel(QL, KL, W, STAT, COLS, G, DW, DA, DDIV, NTIE, ZS, M, D, NBH, GROUP, scale,
                         ITERS: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNKS: tl.constexpr,
                         PREC: tl.constexpr, OUTER: tl.constexpr, IS_F64: tl.constexpr, HAS_W: tl.constexpr,
                         KEPT: tl.constexpr, TRANSPOSED: tl.constexpr):
        # dW, and dL/dA except the batch max's share: DA (BLOCK² per matrix), DDIV = dL/d(max) from this matrix,
        # NTIE = how many of its column sums equal the max (the next kernel splits the summed DDIV over them).
        # HAS_W: G = dL/d(Z·W) (m × d); otherwise G = dL/dZ (m × m) and W, DW are unused. KEPT: ZS holds the
        # forward's iterates and final Z (no replay). TRANSPOSED: the iteration's backward in its transposed form
        # (_pinv_reverse_transposed).
        bh = tl.program_id(0)
        r = tl.arange(0, BLOCK)
        a = _kernel_2(QL, KL, bh, M, D, scale, BLOCK, BLOCK_D, OUTER, IS_F64)
        div = _group_max(STAT, bh, NBH, GROUP, BLOCK_S, CHUNKS)
        eye = tl.where((r[:, None] == r[None, :]) & (r < M)[:, None], 1.0, 0.0).to(a.dtype)
        square = r[:, None] * BLOCK + r[None, :]
        if KEPT:
            zs = ZS + bh.to(tl.int64) * (ITERS + 1) * BLOCK * BLOCK + square
            z = tl.load(zs + ITERS * BLOCK * BLOCK)
        else:
            zs = ZS + bh.to(tl.int64) * ITERS * BLOCK * BLOCK + square
            z = _pinv_replay(a, tl.trans(a) / div, eye, zs, ITERS, BLOCK, PREC)
        if HAS_W:
            w = _to_work(_landmark_tile(W, bh, M, D, BLOCK, BLOCK_D).to(G.dtype.element_ty), IS_F64)
            g = _to_work(_landmark_tile(G, bh, M, D, BLOCK, BLOCK_D), IS_F64)
            _store_landmark_tile(DW, bh, tl.dot(tl.trans(z), g, input_precision=OUTER), M, D, BLOCK, BLOCK_D)
            if TRANSPOSED:
                dz_t = tl.dot(w, tl.trans(g), input_precision=OUTER)
            else:
                dz = tl.dot(g, tl.trans(w), input_precision=OUTER)
        elif TRANSPOSED:
            dz_t = tl.trans(_to_work(_landmark_tile(G, bh, M, M, BLOCK, BLOCK), IS_F64))
        else:
            dz = _to_work(_landmark_tile(G, bh, M, M, BLOCK, BLOCK), IS_F64)
        if TRANSPOSED:  # DAᵀ = daᵀ + dZ₀ / max, stored through transposed offsets
            da_t, dz0_t = _pinv_reverse_transposed(a, dz_t, eye, zs, ITERS, BLOCK, PREC)
            tl.store(DA + bh.to(tl.int64) * BLOCK * BLOCK + r[None, :] * BLOCK + r[:, None],
                     da_t + tl.trans(dz0_t) / div)
            dz0_at = tl.sum(tl.sum(dz0_t * a, axis=1), axis=0)                # Σ dZ₀ ⊙ Aᵀ
        else:
            da, dz0 = _pinv_reverse(a, dz, eye, zs, ITERS, BLOCK, PREC)
            tl.store(DA + bh.to(tl.int64) * BLOCK * BLOCK + square, da + tl.trans(dz0) / div)
            dz0_at = tl.sum(tl.sum(dz0 * tl.trans(a), axis=1), axis=0)
        tl.store(DDIV + bh, -dz0_at / (div * div))  # Z₀ = Aᵀ / max, not kept live
        colsum = tl.load(COLS + bh.to(tl.int64) * M + r, mask=r < M, other=float("-inf"))
        tl.store(NTIE + bh, tl.sum(tl.where(colsum == div, 1.0, 0.0), axis=0).to(NTIE.dtype.element_ty))

    @triton.jit
    def _core_softmax_bwd_kernel(QL, KL, DA, STAT, COLS, DDIV, NTIE, DQL, DKL, M, D, NBH, GROUP, scale,
                                 BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                                 CHUNKS: tl.constexpr, OUTER: tl.constexpr, IS_F64: tl.constexpr):
        bh = tl.program_id(0)
        r = tl.arange(0, BLOCK)
        a = _kernel_2(QL, KL, bh, M, D, scale, BLOCK, BLOCK_D, OUTER, IS_F64)
        div = _group_max(STAT, bh, NBH, GROUP, BLOCK_S, CHUNKS)
        share = (_group_sum(DDIV, bh, NBH, GROUP, BLOCK_S, CHUNKS)
                 / _group_sum(NTIE, bh, NBH, GROUP, BLOCK_S, CHUNKS))
        colsum = tl.load(COLS + bh.to(tl.int64) * M + r, mask=r < M, other=float("-inf"))
        da = tl.load(DA + bh.to(tl.int64) * BLOCK * BLOCK + r[:, None] * BLOCK + r[None, :])
        da += tl.where(colsum == div, share, 0.0)[None, :]                # d(max)/d(column sum), every row
        ds = a * (da - tl.sum(da * a, axis=1)[:, None]) * scale            # softmax backward, then the scale
        q = _to_work(_landmark_tile(QL, bh, M, D, BLOCK, BLOCK_D), IS_F64)
        k = _to_work(_landmark_tile(KL, bh, M, D, BLOCK, BLOCK_D), IS_F64)
        _store_landmark_tile(DQL, bh, tl.dot(ds, k, input_precision=OUTER), M, D, BLOCK, BLOCK_D)
        _store_landmark_tile(DKL, bh, tl.dot(tl.trans(ds), q, input_precision=OUTER), M, D, BLOCK, BLOCK_D)

    @triton.jit
    def _scores_against_keys(ql, K, skb, skh, skn, skd, V, svb, svh, svn, svd, BIAS, b, h, keys, N, D, scale,
                             BLOCK_D: tl.constexpr, PREC: tl.constexpr, HAS_BIAS: tl.constexpr):
        # One block of keys (and their values) for the landmark queries ql: ql·kᵀ·scale + key bias (HAS_BIAS: rows
        # with padding), −inf past N.
        cols = tl.arange(0, BLOCK_D)
        kmask = keys < N
        k64 = keys[:, None].to(tl.int64)
        m2 = kmask[:, None] & (cols[None, :] < D)
        k = tl.load(K + b * skb + h * skh + k64 * skn + cols[None, :] * skd, mask=m2, other=0.0)
        v = tl.load(V + b * svb + h * svh + k64 * svn + cols[None, :] * svd, mask=m2, other=0.0)
        s = tl.dot(ql, tl.trans(k), input_precision=PREC) * scale  # fp32 (fp64 for fp64 inputs)
        if HAS_BIAS:
            s = s + tl.load(BIAS + b * N + keys, mask=kmask, other=0.0).to(s.dtype)[None, :]
        return k, v, tl.where(kmask[None, :], s, float("-inf"))

    @triton.jit
    def _lq_fwd_kernel(QL, K, skb, skh, skn, skd, V, svb, svh, svn, svd, BIAS, ACC, MAX, SUM, OUT, OUT_LOW, LSE,
                       H, N, M, D, scale, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                       TILES: tl.constexpr, PREC: tl.constexpr, IS_F64: tl.constexpr, HAS_BIAS: tl.constexpr,
                       FINISH: tl.constexpr, HAS_LOW: tl.constexpr):
        # Pass 1, split over keys: the m landmark queries against TILES blocks of keys with an online softmax;
        # this program's (running max, sum, weighted V) go to ACC/MAX/SUM for _lq_combine_kernel. At long n
        # and small batch this puts n / (BLOCK_K·TILES) programs on each (batch, head) instead of one.
        # FINISH (one program per (batch, head), e.g. n = 512 in bf16): it writes what the combine would, W in
        # OUT (fp32) and OUT_LOW (the inputs' dtype; HAS_LOW), its log-sum-exp in LSE — one launch fewer.
        bh, b, h = _batch_head(H)
        lm = tl.arange(0, BLOCK_M)
        ql = _landmark_tile(QL, bh, M, D, BLOCK_M, BLOCK_D)
        acc = _accumulator(BLOCK_M, BLOCK_D, IS_F64)
        m_i = tl.zeros([BLOCK_M], dtype=acc.dtype) - 1e30  # finite: a block of only padded keys adds nothing
        l_i = tl.zeros([BLOCK_M], dtype=acc.dtype)
        for t in range(TILES):
            keys = (tl.program_id(1) * TILES + t) * BLOCK_K + tl.arange(0, BLOCK_K)
            k, v, s = _scores_against_keys(ql, K, skb, skh, skn, skd, V, svb, svh, svn, svd, BIAS, b, h, keys, N, D,
                                           scale, BLOCK_D, PREC, HAS_BIAS)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(acc.dtype)
            m_i = m_new
        if FINISH:
            out = acc / l_i[:, None]
            _store_landmark_tile(OUT, bh, out, M, D, BLOCK_M, BLOCK_D)
            if HAS_LOW:
                _store_landmark_tile(OUT_LOW, bh, out, M, D, BLOCK_M, BLOCK_D)
            tl.store(LSE + bh.to(tl.int64) * M + lm, m_i + tl.log(l_i), mask=lm < M)
        else:
            _store_partial(ACC, acc, bh, BLOCK_M, BLOCK_D)
            part = bh.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
            tl.store(MAX + part * BLOCK_M + lm, m_i)
            tl.store(SUM + part * BLOCK_M + lm, l_i)

    @triton.jit
    def _lq_combine_kernel(ACC, MAX, SUM, OUT, OUT_LOW, LSE, M, D, NPROG: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PARTS: tl.constexpr, HAS_LOW: tl.constexpr):
        # Pass 1's NPROG programs over key blocks of one (batch·head), combined for ROWS of its landmark rows
        # (program_id(1)): W = Σ_p e^(max_p − top) acc_p / Σ_p e^(max_p − top) sum_p (in OUT, fp32) and in the
        # inputs' dtype (OUT_LOW; HAS_LOW), its log-sum-exp in LSE. PARTS partials a load: at n = 65,536 a (batch,
        # head) has 128 partials, and one program per (batch, head) reading them one at a time took 172 µs on an
        # H100 for 26 MB (~5% of the bandwidth) — 12 programs for 132 SMs, each waiting on one load after another.
        bh = tl.program_id(0).to(tl.int64)
        lm = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        parts = tl.arange(0, PARTS)
        stat = (bh * NPROG + parts[:, None]) * BLOCK_M + lm[None, :]        # (PARTS, ROWS): the first PARTS
        top = tl.full([ROWS], float("-inf"), MAX.dtype.element_ty)
        for first in range(0, NPROG, PARTS):
            live = (first + parts < NPROG)[:, None]
            top = tl.maximum(top, tl.max(tl.load(MAX + stat + first * BLOCK_M, mask=live, other=float("-inf")),
                                         axis=0))
        total = tl.zeros_like(top)
        acc = tl.zeros([ROWS, BLOCK_D], dtype=top.dtype)
        for first in range(0, NPROG, PARTS):
            live = (first + parts < NPROG)[:, None]
            at = stat + first * BLOCK_M
            weight = tl.exp(tl.load(MAX + at, mask=live, other=float("-inf")) - top[None, :])  # 0 past NPROG
            total += tl.sum(weight * tl.load(SUM + at, mask=live, other=0.0), axis=0)
            tiles = tl.load(ACC + at[:, :, None] * BLOCK_D + cols[None, None, :], mask=live[:, :, None], other=0.0)
            acc += tl.sum(weight[:, :, None] * tiles, axis=0)
        out = acc / total[:, None]
        at = (bh * M + lm[:, None]) * D + cols[None, :]
        inside = (lm[:, None] < M) & (cols[None, :] < D)
        tl.store(OUT + at, out.to(OUT.dtype.element_ty), mask=inside)
        if HAS_LOW:
            tl.store(OUT_LOW + at, out.to(OUT_LOW.dtype.element_ty), mask=inside)
        tl.store(LSE + bh * M + lm, top + tl.log(total), mask=lm < M)

    @triton.jit
    def _lq_bwd_kernel(QL, K, skb, skh, skn, skd, V, svb, svh, svn, svd, BIAS, DW, LSE, WF,
                       DK, sgkb, sgkh, sgkn, sgkd, DV, sgvb, sgvh, sgvn, sgvd, DQL_P, KEEP, DKL, DKL2, H, N, M, D,
                       scale, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                       TILES: tl.constexpr, PREC: tl.constexpr, IS_F64: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_SEG: tl.constexpr):
        # For TILES blocks of keys: dK and dV (written), and this program's partial sum of dQ̃ (summed in PyTorch).
        # HAS_SEG (the one-node layer): dK also gets the landmark means' share, keep · (DKL + DKL2)[segment] / its
        # length (K̃'s gradients from its two uses) — K's gradient written once, with no segment-means pass over it.
        bh, b, h = _batch_head(H)
        cols = tl.arange(0, BLOCK_D)
        lm = tl.arange(0, BLOCK_M)
        ql = _landmark_tile(QL, bh, M, D, BLOCK_M, BLOCK_D)
        dw = _landmark_tile(DW, bh, M, D, BLOCK_M, BLOCK_D)
        dql = _accumulator(BLOCK_M, BLOCK_D, IS_F64)
        lse = tl.load(LSE + bh.to(tl.int64) * M + lm, mask=lm < M, other=0.0).to(dql.dtype)
        # rowsum(dW ⊙ W) with the forward's fp32 W (one m × d tile: cheaper here than 3 PyTorch launches)
        delta = tl.sum(dw.to(dql.dtype) * _landmark_tile(WF, bh, M, D, BLOCK_M, BLOCK_D).to(dql.dtype), axis=1)
        for t in range(TILES):
            keys = (tl.program_id(1) * TILES + t) * BLOCK_K + tl.arange(0, BLOCK_K)
            k, v, s = _scores_against_keys(ql, K, skb, skh, skn, skd, V, svb, svh, svn, svd, BIAS, b, h, keys, N, D,
                                           scale, BLOCK_D, PREC, HAS_BIAS)
            k64 = keys[:, None].to(tl.int64)
            m2 = (keys < N)[:, None] & (cols[None, :] < D)
            p = tl.exp(s - lse[:, None])                                   # (BLOCK_M, BLOCK_K)
            dv = tl.dot(tl.trans(p.to(dw.dtype)), dw, input_precision=PREC)
            tl.store(DV + b * sgvb + h * sgvh + k64 * sgvn + cols[None, :] * sgvd, dv, mask=m2)
            dp = tl.dot(dw, tl.trans(v), input_precision=PREC).to(dql.dtype)
            ds = p * (dp - delta[:, None])
            dk = tl.dot(tl.trans(ds.to(ql.dtype)), ql, input_precision=PREC) * scale
            if HAS_SEG:
                # 32-bit offsets into the (b·h, m, d) landmark gradient: fewer registers than 64-bit ones
                seg = ((keys.to(tl.int64) * M) // N).to(tl.int32)
                count = ((seg + 1).to(tl.int64) * N + M - 1) // M - (seg.to(tl.int64) * N + M - 1) // M
                kp = tl.load(KEEP + b * N + keys, mask=keys < N, other=0.0).to(dk.dtype)
                landmark = (bh * M + seg[:, None]) * D + cols[None, :]
                dkl = (tl.load(DKL + landmark, mask=m2, other=0.0).to(dk.dtype)
                       + tl.load(DKL2 + landmark, mask=m2, other=0.0).to(dk.dtype))
                dk += dkl * (kp / count.to(dk.dtype))[:, None]
            tl.store(DK + b * sgkb + h * sgkh + k64 * sgkn + cols[None, :] * sgkd, dk, mask=m2)
            dql += tl.dot(ds.to(k.dtype), k, input_precision=PREC).to(dql.dtype) * scale
        _store_partial(DQL_P, dql, bh, BLOCK_M, BLOCK_D)

    @triton.jit
    def _conv_band(W, h, KS: tl.constexpr, FLIP: tl.constexpr, BLOCK_N: tl.constexpr, WIN: tl.constexpr,
                   dtype: tl.constexpr):
        # The depthwise conv over BLOCK_N rows as a matrix: the banded Toeplitz matrix of head h's taps (BLOCK_N ×
        # WIN, row r holding the taps at columns r … r + KS − 1), in reverse order if FLIP.
        tap = tl.arange(0, WIN)[None, :] - tl.arange(0, BLOCK_N)[:, None]
        return tl.load(W + h * KS + (KS - 1 - tap if FLIP else tap), mask=(tap >= 0) & (tap < KS),
                       other=0.0).to(dtype)

    @triton.jit
    def _conv_window(X, sxn, sxd, KEEP, b, N, D, src, cols, IN_MASK: tl.constexpr):
        # The rows src of X (this (batch, head)'s base pointer) that a tile's conv reads, zero outside [0, N),
        # times keep if IN_MASK.
        valid = (src >= 0) & (src < N)
        x = tl.load(X + src[:, None].to(tl.int64) * sxn + cols[None, :] * sxd,
                    mask=valid[:, None] & (cols[None, :] < D), other=0.0)
        if IN_MASK:
            x = x * tl.load(KEEP + b * N + src, mask=valid, other=0.0).to(x.dtype)[:, None]
        return x

    @triton.jit
    def _lk_fwd_kernel(Q, sqb, sqh, sqn, sqd, KEEP, KL, ZW, OUT, sob, soh, son, sod, V, svb, svh, svn, svd, TAPS,
                       H, N, M, D, scale, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                       PREC: tl.constexpr, HAS_CONV: tl.constexpr, KS: tl.constexpr, WIN: tl.constexpr):
        # OUT = softmax(keep·Q K̃ᵀ · scale) ZW for one block of query rows. The m ≤ 64 landmark keys fit in one
        # tile, so the softmax is exact in registers (no online rescaling) and the grid is (b·h, n / BLOCK_N).
        # HAS_CONV: plus the depthwise conv of keep·V with taps TAPS (h, KS) over the same rows — the conv
        # kernel's banded product for one tile — so the output is written once (no conv pass reading it back).
        bh, b, h = _batch_head(H)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_D)
        lm = tl.arange(0, BLOCK_M)
        rmask = rows < N
        m2 = rmask[:, None] & (cols[None, :] < D)
        kp = tl.load(KEEP + b * N + rows, mask=rmask, other=0.0)
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None].to(tl.int64) * sqn + cols[None, :] * sqd, mask=m2, other=0.0)
        q = q * kp.to(q.dtype)[:, None]
        kl = _landmark_tile(KL, bh, M, D, BLOCK_M, BLOCK_D)
        zw = _landmark_tile(ZW, bh, M, D, BLOCK_M, BLOCK_D)
        s = tl.dot(q, tl.trans(kl), input_precision=PREC) * scale
        s = tl.where((lm < M)[None, :], s, float("-inf"))
        p = tl.exp(s - tl.max(s, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        o = tl.dot(p.to(zw.dtype), zw, input_precision=PREC)
        if HAS_CONV:
            band = _conv_band(TAPS, h, KS, False, BLOCK_N, WIN, V.dtype.element_ty)
            src = tl.program_id(1) * BLOCK_N - KS // 2 + tl.arange(0, WIN)
            x = _conv_window(V + b * svb + h * svh, svn, svd, KEEP, b, N, D, src, cols, True)
            o += tl.dot(band, x, input_precision=PREC).to(o.dtype)
        tl.store(OUT + b * sob + h * soh + rows[:, None].to(tl.int64) * son + cols[None, :] * sod, o, mask=m2)

    @triton.jit
    def _lk_bwd_kernel(Q, sqb, sqh, sqn, sqd, KEEP, KL, ZW, DO, sdb, sdh, sdn, sdd, DQ, sgb, sgh, sgn, sgd,
                       DKL_P, DZW_P, H, N, M, D, scale, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_D: tl.constexpr, TILES: tl.constexpr, PREC: tl.constexpr, IS_F64: tl.constexpr):
        # For TILES blocks of query rows: dQ (written, × keep), and this program's partial sums of dK̃ and d(ZW)
        # over its rows (summed over programs in PyTorch) — the reductions over n that a flash-style backward
        # over only 64 keys runs on one block per (batch, head).
        bh, b, h = _batch_head(H)
        cols = tl.arange(0, BLOCK_D)
        lm = tl.arange(0, BLOCK_M)
        kl = _landmark_tile(KL, bh, M, D, BLOCK_M, BLOCK_D)
        zw = _landmark_tile(ZW, bh, M, D, BLOCK_M, BLOCK_D)
        dkl = _accumulator(BLOCK_M, BLOCK_D, IS_F64)
        dzw = tl.zeros_like(dkl)
        for t in range(TILES):
            rows = (tl.program_id(1) * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            rmask = rows < N
            m2 = rmask[:, None] & (cols[None, :] < D)
            r64 = rows[:, None].to(tl.int64)
            kp = tl.load(KEEP + b * N + rows, mask=rmask, other=0.0)
            q = tl.load(Q + b * sqb + h * sqh + r64 * sqn + cols[None, :] * sqd, mask=m2, other=0.0)
            q = q * kp.to(q.dtype)[:, None]
            do = tl.load(DO + b * sdb + h * sdh + r64 * sdn + cols[None, :] * sdd, mask=m2, other=0.0)
            s = tl.dot(q, tl.trans(kl), input_precision=PREC) * scale
            s = tl.where((lm < M)[None, :], s, float("-inf"))
            p = tl.exp(s - tl.max(s, axis=1)[:, None])
            p = p / tl.sum(p, axis=1)[:, None]
            dp = tl.dot(do, tl.trans(zw), input_precision=PREC)
            ds = p * (dp - tl.sum(p * dp, axis=1)[:, None])       # d loss / d s
            dq = tl.dot(ds.to(kl.dtype), kl, input_precision=PREC) * scale
            dq = dq * kp.to(dq.dtype)[:, None]
            tl.store(DQ + b * sgb + h * sgh + r64 * sgn + cols[None, :] * sgd, dq, mask=m2)
            dkl += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC) * scale
            dzw += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        _store_partial(DKL_P, dkl, bh, BLOCK_M, BLOCK_D)
        _store_partial(DZW_P, dzw, bh, BLOCK_M, BLOCK_D)

    @triton.jit
    def _segmeans_kernel(X, sxb, sxh, sxn, sxd, X2, s2b, s2h, s2n, s2d, KEEP, OUT, OUT2, H, N, M, D,
                         NCHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IS_F64: tl.constexpr,
                         HAS_X2: tl.constexpr):
        # OUT[b,h,i,:] = mean of X·keep over segment i; HAS_X2: the same for X2 into OUT2 (the one-node layer's Q
        # and K: one launch, the keep vector read once).
        bh = tl.program_id(0)
        i = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        start = (i * N + M - 1) // M
        end = ((i + 1) * N + M - 1) // M
        cols = tl.arange(0, BLOCK_D)
        if IS_F64:
            acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float64)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        acc2 = tl.zeros_like(acc)
        for c in range(NCHUNK):  # constexpr trip count (segments are at most NCHUNK * BLOCK_N long)
            rows = start + c * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = rows < end
            m2 = valid[:, None] & (cols[None, :] < D)
            kp = tl.load(KEEP + b * N + rows, mask=valid, other=0.0)[:, None].to(acc.dtype)
            x = tl.load(X + b * sxb + h * sxh + rows[:, None].to(tl.int64) * sxn + cols[None, :] * sxd,
                        mask=m2, other=0.0)
            acc += x.to(acc.dtype) * kp
            if HAS_X2:
                x2 = tl.load(X2 + b * s2b + h * s2h + rows[:, None].to(tl.int64) * s2n + cols[None, :] * s2d,
                             mask=m2, other=0.0)
                acc2 += x2.to(acc.dtype) * kp
        at = (bh.to(tl.int64) * M + i) * D + cols
        tl.store(OUT + at, tl.sum(acc, axis=0) / (end - start), mask=cols < D)
        if HAS_X2:
            tl.store(OUT2 + at, tl.sum(acc2, axis=0) / (end - start), mask=cols < D)

    @triton.jit
    def _segmeans_bwd_kernel(G, G2, s2bh, s2p, s2m, KEEP, ADD, sab, sah, san, sad, GX, sxb, sxh, sxn, sxd, H, N,
                             M, D, HAS_G2: tl.constexpr, G2_PARTS: tl.constexpr, HAS_ADD: tl.constexpr,
                             MASK_ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             IS_F64: tl.constexpr):
        # GX[b,h,p,:] = keep[b,p] * G[b,h,i,:] / len(segment i)  (+ ADD[b,h,p,:], times keep[b,p] if MASK_ADD),
        # i = floor(p·M/N): the input-sized gradient written once, with the gradient of the input's other use
        # (ADD) folded in instead of autograd's separate accumulation pass. HAS_G2: the landmarks' gradient is
        # G + G2 (their two uses), added here rather than by a launch of its own; G2 given as G2_PARTS per-program
        # partials (at G2 + bh·s2bh + part·s2p + i·s2m) is summed here too, instead of by a launch before.
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < N
        seg = (rows.to(tl.int64) * M) // N
        count = ((seg + 1) * N + M - 1) // M - (seg * N + M - 1) // M
        m2 = rmask[:, None] & (cols[None, :] < D)
        kp = tl.load(KEEP + b * N + rows, mask=rmask, other=0.0)
        landmark = (bh.to(tl.int64) * M + seg[:, None]) * D + cols[None, :]
        g = tl.load(G + landmark, mask=m2, other=0.0)
        if IS_F64:
            g = g.to(tl.float64)
            kp = kp.to(tl.float64)
        else:
            g = g.to(tl.float32)
            kp = kp.to(tl.float32)
        if HAS_G2:
            at2 = G2 + bh.to(tl.int64) * s2bh + seg[:, None] * s2m + cols[None, :]
            for part in range(G2_PARTS):
                g += tl.load(at2 + part * s2p, mask=m2, other=0.0).to(g.dtype)
        out = g * (kp / count.to(g.dtype))[:, None]
        if HAS_ADD:
            add = tl.load(ADD + b * sab + h * sah + rows[:, None].to(tl.int64) * san + cols[None, :] * sad,
                          mask=m2, other=0.0).to(out.dtype)
            if MASK_ADD:
                add = add * kp[:, None]
            out += add
        tl.store(GX + b * sxb + h * sxh + rows[:, None].to(tl.int64) * sxn + cols[None, :] * sxd, out, mask=m2)

    @triton.jit
    def _dwconv_kernel(X, sxb, sxh, sxn, sxd, KEEP, W, RES, srb, srh, srn, srd, OUT, sob, soh, son, sod, H, N, D,
                       KS: tl.constexpr, FLIP: tl.constexpr,
                       IN_MASK: tl.constexpr, OUT_MASK: tl.constexpr, HAS_RES: tl.constexpr,
                       BLOCK_N: tl.constexpr, WIN: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr,
                       PREC: tl.constexpr):
        # OUT[b,h,i,:] = RES[b,h,i,:] + out_keep[i] * sum_t W[h,t] * in_keep[i+t-KS//2] * X[b,h,i+t-KS//2,:]
        # A tile of BLOCK_N output rows is one matrix product: the banded Toeplitz matrix of the taps
        # (BLOCK_N × WIN, WIN ≥ BLOCK_N + KS - 1) times the window of input rows it reads (WIN × d). Each input
        # row is loaded ~WIN/BLOCK_N times instead of KS times, and the sum runs on the tensor cores.
        # FLIP: the taps in reverse order (the input gradient's conv), read so rather than copied flipped.
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        pad = KS // 2
        band = _conv_band(W, h, KS, FLIP, BLOCK_N, WIN, X.dtype.element_ty)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols[None, :] < D
        base = X + b * sxb + h * sxh
        for tile in range(TILES):
            row0 = (tl.program_id(1) * TILES + tile) * BLOCK_N
            src = row0 - pad + tl.arange(0, WIN)
            x = _conv_window(base, sxn, sxd, KEEP, b, N, D, src, cols, IN_MASK)
            acc = tl.dot(band, x, input_precision=PREC)
            rows = row0 + tl.arange(0, BLOCK_N)
            rmask = rows < N
            if OUT_MASK:
                acc = acc * tl.load(KEEP + b * N + rows, mask=rmask, other=0.0).to(acc.dtype)[:, None]
            if HAS_RES:
                res = tl.load(RES + b * srb + h * srh + rows[:, None].to(tl.int64) * srn + cols[None, :] * srd,
                              mask=rmask[:, None] & cmask, other=0.0)
                acc += res.to(acc.dtype)
            out = OUT + b * sob + h * soh + rows[:, None].to(tl.int64) * son + cols[None, :] * sod
            tl.store(out, acc, mask=rmask[:, None] & cmask)

    @triton.jit
    def _dwconv_wgrad_kernel(X, sxb, sxh, sxn, sxd, KEEP, G, PART, H, N, D, KS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IS_F64: tl.constexpr):
        # PART[bh, blk, t] = sum_{i in blk, :} G[b,h,i,:] * keep[i+t-KS//2] * X[b,h,i+t-KS//2,:]
        bh = tl.program_id(0)
        blk = tl.program_id(1)
        nblk = tl.num_programs(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols[None, :] < D
        if IS_F64:
            g = tl.load(G + bh.to(tl.int64) * N * D + rows[:, None].to(tl.int64) * D + cols[None, :],
                        mask=(rows[:, None] < N) & cmask, other=0.0).to(tl.float64)
        else:
            g = tl.load(G + bh.to(tl.int64) * N * D + rows[:, None].to(tl.int64) * D + cols[None, :],
                        mask=(rows[:, None] < N) & cmask, other=0.0).to(tl.float32)
        base = X + b * sxb + h * sxh
        pad = KS // 2
        for t in range(KS):
            src = rows + t - pad
            valid = (src >= 0) & (src < N)
            x = tl.load(base + src[:, None].to(tl.int64) * sxn + cols[None, :] * sxd,
                        mask=valid[:, None] & cmask, other=0.0).to(g.dtype)
            kp = tl.load(KEEP + b * N + src, mask=valid, other=0.0).to(g.dtype)
            s = tl.sum(tl.sum(g * x * kp[:, None], axis=1), axis=0)
            tl.store(PART + (bh.to(tl.int64) * nblk + blk) * KS + t, s)


def _check():
    if triton is None:
        raise RuntimeError(f"triton is not importable: {_IMPORT_ERROR}")


# ----------------------------------------------------------------------------------------------- torch.compile
# Every launch goes through a function wrapped by ``_opaque``: eager calls run it directly (a custom op's Python
# dispatch costs ~11 µs a call, and host time is what the H100 model step is short of), while under torch.compile
# it is a custom op ``nystromformer::<name>`` with a fake (shape-only) implementation, so dynamo never traces
# Triton's launcher and the compiled step — CUDA graphs included — launches the same kernels.
def _opaque(fake):
    def wrap(fn):
        op = torch.library.custom_op(f"nystromformer::{fn.__name__.lstrip('_')}", mutates_args=())(fn)
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args)
        call.op = op
        return call
    return wrap


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------- pinv
# Warps per program (fwd, bwd) for the 64×64 block, by precision: the fastest in bench/pinv_speed.py on the H100
# (docs/performance.md; 1,536 matrices, fwd+bwd ms: tf32 1.36 at (4, 4) vs 1.73 at (8, 8); tf32x3 4.40 vs 5.71;
# ieee 13.5 at (8, 8) vs 92 at (4, 4), where 4 warps spill). Smaller blocks use 4. ``pinv_iterate(...,
# warps=(f, b))`` overrides them.
PINV_WARPS_64 = {"tf32": (4, 4), "tf32x3": (4, 4), "ieee": (8, 8)}
# The iteration's backward (pinv kernel and landmark core) in its transposed form, _pinv_reverse_transposed: the
# same products, 112 KB of shared memory instead of 160 at tf32 and 4 warps, so two programs per SM instead of one
# — but more spills (532 B vs 408). Timed on an H100 (docs/performance.md, bf16 landmarks, fwd+bwd ms): the
# landmark core 1.07 vs 1.89 at 1,536 matrices with 4 warps (1.83 with 8), 0.71 vs 0.73 at 192, 0.68 vs 0.86 at
# 12; the pinv kernel alone about the same either way (1.42 vs 1.55 at 1,536, 0.87 vs 0.89 at 192).
PINV_BACKWARD_TRANSPOSED = True


def _pinv_warps(m: int, precision: str, warps: int, which: int) -> int:
    return warps or (PINV_WARPS_64[precision][which] if _block(m) == 64 else 4)


@_opaque(lambda a, z0, iters, precision, warps: a.new_empty(a.shape))
def _pinv_forward(a: torch.Tensor, z0: torch.Tensor, iters: int, precision: str, warps: int) -> torch.Tensor:
    a, z0 = a.contiguous(), z0.contiguous()
    m = a.shape[-1]
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    _pinv_fwd_kernel[(a.numel() // (m * m),)](a, z0, out, m, ITERS=iters, BLOCK=_block(m), PREC=precision,
                                              num_warps=_pinv_warps(m, precision, warps, 0))
    return out


@_opaque(lambda a, z0, g, iters, precision, warps: (a.new_empty(a.shape), a.new_empty(a.shape)))
def _pinv_backward(a: torch.Tensor, z0: torch.Tensor, g: torch.Tensor, iters: int, precision: str,
                   warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    a, z0 = a.contiguous(), z0.contiguous()
    m = a.shape[-1]
    bsz = a.numel() // (m * m)
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    dz0 = torch.empty_like(da)
    block = _block(m)
    scratch = torch.empty(bsz, iters, block, block, device=a.device, dtype=a.dtype)
    _pinv_bwd_kernel[(bsz,)](a, z0, g.contiguous(), da, dz0, scratch, m, ITERS=iters, BLOCK=block, PREC=precision,
                             TRANSPOSED=PINV_BACKWARD_TRANSPOSED, num_warps=_pinv_warps(m, precision, warps, 1))
    return da, dz0


class _PinvIterate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, z0, iters, precision, warps):
        ctx.save_for_backward(a, z0)
        ctx.iters, ctx.precision, ctx.warps = iters, precision, warps
        return _pinv_forward(a, z0, iters, precision, warps[0])

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients have no graph
    def backward(ctx, g):
        a, z0 = ctx.saved_tensors
        da, dz0 = _pinv_backward(a, z0, g, ctx.iters, ctx.precision, ctx.warps[1])
        return da, dz0, None, None, None


def pinv_iterate(a: torch.Tensor, z0: torch.Tensor, iters: int, precision: str = "ieee",
                 warps: tuple[int, int] | None = None) -> torch.Tensor:
    """``iters`` steps of Z ← ¼ Z (13I − AZ(15I − AZ(7I − AZ))) from ``z0``, for every matrix in a (..., m, m).

    ``precision``: Triton's input_precision for the products ("ieee", "tf32x3" or "tf32"; fp64 is always exact).
    ``warps``: (forward, backward) warps per program, default ``PINV_WARPS_64`` (4 below 64)."""
    _check()
    m = a.shape[-1]
    if a.shape[-2] != m or m > MAX_LANDMARKS:
        raise ValueError(f"pinv kernel: needs square matrices with m <= {MAX_LANDMARKS}, got {tuple(a.shape)}")
    if a.dtype not in (torch.float32, torch.float64):
        raise ValueError("pinv kernel: computes in float32 or float64")
    if a.dtype == torch.float64:
        precision = "ieee"  # tf32 modes apply to fp32 operands only
    return _PinvIterate.apply(a, z0.to(a.dtype), iters, precision, warps or (0, 0))


# ----------------------------------------------------------------------------------------------- landmark core
CORE_BLOCK_S = 256  # batch-wide reductions read b·h floats in chunks of this many
# Warps per program of the core's kernels. 8 spill least at 64 × 64 (ptxas, sm_90: backward 824 B vs 1,788 at 4
# warps), yet 4 ran faster on an H100 (with the transposed backward, 1,536 matrices: forward 0.28 vs 0.44 ms,
# fwd+bwd 1.07 vs 1.83; docs/performance.md).
CORE_WARPS = 4
# Up to this many matrices (batch · heads) the core's forward keeps the iterate entering each step and the final
# Z (112 KB per matrix at m = 64, 6 steps), and the backward skips replaying the forward — a quarter of its
# products, where its latency is the cost (long n, small batch: 12 matrices at 65,536 tokens, one wave on 12 SMs).
# Off (0): timed on an H100 only with the former settings (8 warps, direct backward: 8% faster at 12 and 1,536
# matrices, 20% slower at 192), not yet with the current ones (bench/pinv_speed.py --middle-only). Per layer it
# keeps 448/n of an fp32 (b, h, n, d) tensor — little at 65,536, more than a bf16 q-sized tensor at n = 512.
CORE_KEEP_MAX = 0


def _core_warps(m: int, d: int) -> int:
    # At head_dim ≤ 16, 8 warps made Triton 3.6 read shared memory out of bounds in the bf16 backward (an illegal
    # memory access on an H100, compute-sanitizer: _core_bwd_kernel's dG·Wᵀ product); 4 are correct there.
    return CORE_WARPS if _block(m) == 64 and _block(d) > 16 else 4


def init_group(b: int, h: int, init_rows: Optional[int]) -> int:
    """How many (batch, head) matrices share init="original"'s max: init_rows batch rows of h heads each, or the
    whole batch (init_rows None)."""
    if init_rows is not None and init_rows < 1:
        raise ValueError(f"init_rows: must be >= 1 (or None for the whole batch), got {init_rows}")
    return b * h if init_rows is None or init_rows >= b else init_rows * h


def _core_consts(q_land: torch.Tensor, precision: str, group: Optional[int] = None) -> dict:
    f64 = q_land.dtype == torch.float64
    nbh = q_land.shape[0] * q_land.shape[1]
    # PREC: the iteration's products (the pinv kernel's precision); OUTER: the products around it (Q̃K̃ᵀ, Z·W and
    # their gradients), near fp32 whatever the iteration's setting, as the PyTorch path's fp32 matmuls.
    return dict(BLOCK=_block(q_land.shape[-2]), BLOCK_D=_block(q_land.shape[-1]), BLOCK_S=CORE_BLOCK_S,
                CHUNKS=_cdiv(min(group or nbh, nbh), CORE_BLOCK_S), PREC="ieee" if f64 else precision,
                OUTER="ieee" if f64 else "tf32x3", IS_F64=f64)


@_opaque(lambda q_land, k_land: (q_land.new_empty(q_land.shape[:2], dtype=_acc_dtype(q_land.dtype)),
                                 q_land.new_empty(q_land.shape[:3], dtype=_acc_dtype(q_land.dtype))))
def _core_stats(q_land: torch.Tensor, k_land: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each matrix's max column sum of kernel_2 (b, h) and the column sums (b, h, m)."""
    b, h, m, d = q_land.shape
    c = _core_consts(q_land, "ieee")
    stat = torch.empty(b, h, device=q_land.device, dtype=_acc_dtype(q_land.dtype))
    cols = torch.empty(b, h, m, device=q_land.device, dtype=stat.dtype)
    _core_stats_kernel[(b * h,)](q_land.contiguous(), k_land.contiguous(), cols, stat, m, d, d ** -0.5,
                                 BLOCK=c["BLOCK"], BLOCK_D=c["BLOCK_D"], PREC=c["OUTER"], IS_F64=c["IS_F64"],
                                 num_warps=4)
    return stat, cols


def _kept_shape(q_land: torch.Tensor, iters: int, keep: bool, always: bool = False) -> tuple:
    """Where the forward keeps its iterates for the backward: (b·h, iters + 1, block, block) — the iterate entering
    each step, then the final one — for at most CORE_KEEP_MAX matrices (any number if ``always``: a forward run
    inside the backward, whose iterates live only until the core's backward right after), else (0,) (the backward
    then replays the forward into a scratch buffer of b·h · iters blocks)."""
    nbh = q_land.shape[0] * q_land.shape[1]
    block = _block(q_land.shape[-2])
    return (nbh, iters + 1, block, block) if keep and (always or nbh <= CORE_KEEP_MAX) and iters > 0 else (0,)


def _core_iterate(q_land, k_land, w, stat, iters, precision, has_w, keep, group, always=False, zw_dtype=None):
    """Z·W (``has_w``; in ``zw_dtype``, default W's) or Z, and the iterates kept (``_kept_shape``); the init's max
    over each ``group`` of matrices (``init_group``)."""
    b, h, m, d = q_land.shape
    c = _core_consts(q_land, precision, group)
    out = (torch.empty(w.shape, device=w.device, dtype=zw_dtype or w.dtype) if has_w else
           torch.empty(b, h, m, m, device=stat.device, dtype=stat.dtype))
    zs = torch.empty(_kept_shape(q_land, iters, keep, always), device=stat.device, dtype=stat.dtype)
    _core_fwd_kernel[(b * h,)](q_land.contiguous(), k_land.contiguous(), w.contiguous() if has_w else out, stat, out,
                               zs, m, d, b * h, group, d ** -0.5, ITERS=iters, HAS_W=has_w, KEEP=zs.numel() > 0,
                               num_warps=_core_warps(m, d), **c)
    return out, zs


def _core_reverse(q_land, k_land, w, stat, cols, zs, g, iters, precision, has_w, group, land_dtype=None,
                  dw_dtype=None):
    """The core's backward: dQ̃, dK̃ (in ``land_dtype``, default the landmarks' own) and dW (None without W; in
    ``dw_dtype``, default W's). W is rounded to g's dtype, as the forward rounded it to Z·W's."""
    b, h, m, d = q_land.shape
    c = _core_consts(q_land, precision, group)
    q_land, k_land = q_land.contiguous(), k_land.contiguous()
    work = stat.dtype
    block = c["BLOCK"]
    dw = torch.empty(w.shape, device=w.device, dtype=dw_dtype or w.dtype) if has_w else None
    da = torch.empty(b * h, block, block, device=g.device, dtype=work)
    ddiv = torch.empty(b * h, device=g.device, dtype=work)
    ntie = torch.empty_like(ddiv)
    kept = zs.numel() > 0
    scratch = zs if kept else torch.empty(b * h, iters, block, block, device=g.device, dtype=work)
    g = g.contiguous() if has_w else g.to(work).contiguous()
    _core_bwd_kernel[(b * h,)](q_land, k_land, w.contiguous() if has_w else g, stat, cols, g,
                               dw if has_w else da, da, ddiv, ntie, scratch, m, d, b * h, group, d ** -0.5,
                               ITERS=iters,
                               HAS_W=has_w, KEPT=kept, TRANSPOSED=PINV_BACKWARD_TRANSPOSED,
                               num_warps=_core_warps(m, d), **c)
    land = dict(device=q_land.device, dtype=land_dtype or q_land.dtype)
    dq_land, dk_land = torch.empty(q_land.shape, **land), torch.empty(k_land.shape, **land)
    c.pop("PREC")
    _core_softmax_bwd_kernel[(b * h,)](q_land, k_land, da, stat, cols, ddiv, ntie, dq_land, dk_land, m, d, b * h,
                                       group, d ** -0.5, num_warps=_core_warps(m, d), **c)
    return dq_land, dk_land, dw


@_opaque(lambda q_land, k_land, w, stat, iters, precision, keep, group: (
    w.new_empty(w.shape), stat.new_empty(_kept_shape(q_land, iters, keep))))
def _core_forward(q_land: torch.Tensor, k_land: torch.Tensor, w: torch.Tensor, stat: torch.Tensor, iters: int,
                  precision: str, keep: bool, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Z·W, and the iterates kept for the backward (``keep``: a backward will run; empty beyond CORE_KEEP_MAX
    matrices, or without keep)."""
    return _core_iterate(q_land, k_land, w, stat, iters, precision, has_w=True, keep=keep, group=group)


@_opaque(lambda q_land, k_land, w, stat, cols, zs, g, iters, precision, group: (
    q_land.new_empty(q_land.shape), k_land.new_empty(k_land.shape), w.new_empty(w.shape)))
def _core_backward(q_land: torch.Tensor, k_land: torch.Tensor, w: torch.Tensor, stat: torch.Tensor,
                   cols: torch.Tensor, zs: torch.Tensor, g: torch.Tensor, iters: int,
                   precision: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _core_reverse(q_land, k_land, w, stat, cols, zs, g, iters, precision, has_w=True, group=group)


@_opaque(lambda q_land, k_land, stat, iters, precision, keep, group: (
    stat.new_empty(q_land.shape[:3] + q_land.shape[2:3]), stat.new_empty(_kept_shape(q_land, iters, keep))))
def _core_pinv_forward(q_land: torch.Tensor, k_land: torch.Tensor, stat: torch.Tensor, iters: int,
                       precision: str, keep: bool, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _core_iterate(q_land, k_land, None, stat, iters, precision, has_w=False, keep=keep, group=group)


@_opaque(lambda q_land, k_land, stat, cols, zs, g, iters, precision, group: (q_land.new_empty(q_land.shape),
                                                                             k_land.new_empty(k_land.shape)))
def _core_pinv_backward(q_land: torch.Tensor, k_land: torch.Tensor, stat: torch.Tensor, cols: torch.Tensor,
                        zs: torch.Tensor, g: torch.Tensor, iters: int,
                        precision: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _core_reverse(q_land, k_land, None, stat, cols, zs, g, iters, precision, has_w=False, group=group)[:2]


class _LandmarkCore(torch.autograd.Function):
    """Z·W (``w`` given: landmark_core) or Z alone (``w=None``: landmark_pinv), one node either way."""

    @staticmethod
    def forward(ctx, q_land, k_land, w, iters, precision, keep, group):
        stat, cols = _core_stats(q_land, k_land)
        if w is None:
            out, zs = _core_pinv_forward(q_land, k_land, stat, iters, precision, keep, group)
            ctx.save_for_backward(q_land, k_land, stat, cols, zs)
        else:
            out, zs = _core_forward(q_land, k_land, w, stat, iters, precision, keep, group)
            ctx.save_for_backward(q_land, k_land, w, stat, cols, zs)
        ctx.iters, ctx.precision, ctx.has_w, ctx.group = iters, precision, w is not None, group
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        if ctx.has_w:
            dq_land, dk_land, dw = _core_backward(*ctx.saved_tensors, g, ctx.iters, ctx.precision, ctx.group)
        else:
            (dq_land, dk_land), dw = _core_pinv_backward(*ctx.saved_tensors, g, ctx.iters, ctx.precision,
                                                         ctx.group), None
        return dq_land, dk_land, dw, None, None, None, None


def _backward_follows(*inputs: torch.Tensor) -> bool:
    # Inside an autograd.Function's forward grad mode is off and needs_input_grad ignores no_grad: decide here.
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


def _check_core(name: str, q_land: torch.Tensor):
    _check()
    if q_land.shape[-2] > MAX_LANDMARKS or q_land.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"{name}: at most {MAX_LANDMARKS} landmarks and head_dim {MAX_HEAD_DIM}, got "
                         f"{tuple(q_land.shape)}")


def landmark_core(q_land: torch.Tensor, k_land: torch.Tensor, w: torch.Tensor, iters: int,
                  precision: str = "tf32x3", init_rows: Optional[int] = None) -> torch.Tensor:
    """``pinv(softmax(Q̃ K̃ᵀ / √d)) @ W`` for landmarks (b, h, m, d), m ≤ 64, with the paper's
    ``init="original"`` (Z₀ = Aᵀ / the max column sum over the whole batch) and ``iters`` steps of the
    iteration: 2 launches forward and 2 backward instead of ~30 PyTorch operators (softmax, init, the max's
    backward, casts, products). Computed in fp32 (fp64 for fp64 inputs) whatever the input dtype; ``precision`` is
    the iteration's ``input_precision`` as for ``pinv_iterate``; the products around it are near fp32 ("tf32x3").
    The result has W's dtype. Gradients as autograd's through the PyTorch composition, including torch.max's even
    split over tied column sums (``tests/test_nystrom_fast.py``). ``init_rows``: the max over each group of that
    many batch rows instead (``nystrom.iterative_pinv``)."""
    _check_core("landmark_core", q_land)
    return _LandmarkCore.apply(q_land, k_land, w, iters, precision, _backward_follows(q_land, k_land, w),
                               init_group(*q_land.shape[:2], init_rows))


def landmark_pinv(q_land: torch.Tensor, k_land: torch.Tensor, iters: int, precision: str = "tf32x3",
                  init_rows: Optional[int] = None) -> torch.Tensor:
    """``pinv(softmax(Q̃ K̃ᵀ / √d))`` alone, (b, h, m, m) in fp32 (fp64 for fp64 inputs): ``landmark_core``
    without the product with W, which the caller makes. It does not need W, so it can run while pass 1 computes
    W (``nystrom_fast``'s side stream); same kernels, same launches, same numerics for Z."""
    _check_core("landmark_pinv", q_land)
    return _LandmarkCore.apply(q_land, k_land, None, iters, precision, _backward_follows(q_land, k_land),
                               init_group(*q_land.shape[:2], init_rows))


# ----------------------------------------------------------------------------------------------- pass 2
def _dot_precision(dtype) -> str:
    # 16-bit operands use their own tensor-core type (the precision argument is ignored for them)
    return {torch.float32: "tf32x3", torch.float64: "ieee"}.get(dtype, "tf32")


def _lq_consts(q_land: torch.Tensor, backward: bool) -> dict:
    # Keys per block: forward 64 (fp32: 32), backward 32 (fp32: 16) — no spills at 8 warps (ptxas, sm_90). The
    # fp32 backward runs 4 warps: at 8, Triton 3.6 compiled it wrong on an H100 (head_dim 64: an out-of-bounds
    # shared-memory read, compute-sanitizer; head_dim 32: dQ̃ off by 67% with no error); 4 are correct at 16–64.
    # With "tiles", the key blocks a program runs at most (the caller's, not a kernel constant).
    small = q_land.element_size() <= 2
    s = _launch("lq_backward_raw" if backward else "lq_forward_raw", q_land.dtype,
                rows=(32 if small else 16) if backward else (64 if small else 32), tiles=8,
                num_warps=8 if small or not backward else 4)
    if backward and not small and s["num_warps"] > 4:
        raise ValueError(f"pass 1's {q_land.dtype} backward at {s['num_warps']} warps: Triton 3.6 miscompiles it "
                         f"for sm_90 (docs/performance.md, \"Two Triton miscompiles\")")
    return dict(BLOCK_M=_block(q_land.shape[-2]), BLOCK_K=s["rows"], BLOCK_D=_block(q_land.shape[-1]),
                PREC=_dot_precision(q_land.dtype), IS_F64=q_land.dtype == torch.float64, tiles=s["tiles"],
                **_warps(s))


def _bias_or(key_bias: Optional[torch.Tensor], stand_in: torch.Tensor) -> torch.Tensor:
    """The bias for the kernel, or (HAS_BIAS false: never read) any tensor as a stand-in pointer."""
    return key_bias.contiguous() if key_bias is not None else stand_in


def _lq_forward_fake(q_land, k, v, key_bias):
    acc = _acc_dtype(q_land.dtype)
    out = q_land.new_empty(q_land.shape, dtype=acc)
    return out, q_land.new_empty(q_land.shape[:-1], dtype=acc), q_land.new_empty(q_land.shape)


def lq_forward_raw(q_land: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: Optional[torch.Tensor],
                   low: bool = True) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """W (in the accumulation dtype), its log-sum-exp, and (``low``) W in the inputs' dtype, else None — all from
    the one program per (batch, head) or one combine launch after the key-block programs."""
    b, h, m, d = q_land.shape
    n = k.shape[-2]
    q_land = q_land.contiguous()
    acc_t = _acc_dtype(q_land.dtype)
    c = _lq_consts(q_land, backward=False)
    tiles = min(c.pop("tiles"), _cdiv(n, c["BLOCK_K"]))
    nprog = _cdiv(n, c["BLOCK_K"] * tiles)
    out = torch.empty(b, h, m, d, device=k.device, dtype=acc_t)
    out_low = torch.empty(b, h, m, d, device=k.device, dtype=q_land.dtype) if low else None
    lse = torch.empty(b, h, m, device=k.device, dtype=acc_t)
    finish = nprog == 1  # the one program writes W itself (FINISH: the partials are never read)
    acc = out if finish else torch.empty(b * h, nprog, c["BLOCK_M"], c["BLOCK_D"], device=k.device, dtype=acc_t)
    mx = lse if finish else torch.empty(b * h, nprog, c["BLOCK_M"], device=k.device, dtype=acc_t)
    sm = lse if finish else torch.empty_like(mx)
    low_or = out_low if low else out  # a stand-in pointer, never written
    _lq_fwd_kernel[(b * h, nprog)](q_land, k, *k.stride(), v, *v.stride(), _bias_or(key_bias, k), acc, mx, sm,
                                   out, low_or, lse, h, n, m, d, d ** -0.5, TILES=tiles,
                                   HAS_BIAS=key_bias is not None, FINISH=finish, HAS_LOW=low, **c)
    if not finish:
        # landmark rows a program (several programs a (batch, head): at long n there are few of those) and
        # partials a load (ptxas, sm_90: 72 registers, no spills)
        s = _launch("lq_combine", q_land.dtype, rows=4, parts=16, num_warps=4)
        rows = min(_pow2(s["rows"]), c["BLOCK_M"])
        _lq_combine_kernel[(b * h, c["BLOCK_M"] // rows)](
            acc, mx, sm, out, low_or, lse, m, d, NPROG=nprog, BLOCK_M=c["BLOCK_M"], BLOCK_D=c["BLOCK_D"],
            ROWS=rows, PARTS=min(_pow2(s["parts"]), _pow2(nprog)), HAS_LOW=low, **_warps(s))
    return out, lse, out_low


@_opaque(_lq_forward_fake)
def _lq_forward(q_land: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lq_forward_raw`` with W in the inputs' dtype too (a copy even if the same dtype: a custom op's outputs
    do not alias)."""
    return lq_forward_raw(q_land, k, v, key_bias, low=True)


def _lq_backward_fake(q_land, k, v, key_bias, out, lse, g):
    return q_land.new_empty(q_land.shape), torch.empty_like(k), torch.empty_like(v)


@_opaque(_lq_backward_fake)
def _lq_backward(q_land: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: Optional[torch.Tensor],
                 out: torch.Tensor, lse: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dql, dk, dv = lq_backward_raw(q_land, k, v, key_bias, out, lse, g)
    return dql.to(q_land.dtype), dk, dv


def _partial_sum(parts: torch.Tensor, shape) -> torch.Tensor:
    """Per-program partial sums (b·h, programs, BLOCK_M, BLOCK_D) added up: (b, h, m, d), contiguous (with one
    program, e.g. n = 512, the partial itself: a launch fewer)."""
    b, h, m, d = shape
    total = parts[:, 0] if parts.shape[1] == 1 else parts.sum(1)
    return total[:, :m, :d].reshape(b, h, m, d).contiguous()


def lq_backward_raw(q_land, k, v, key_bias, out, lse, g, seg=None, partials=False):
    """Pass 1's backward, no autograd: dQ̃ (in the accumulation dtype), dK, dV. ``seg`` = (keep, dkl, dkl2): also add
    the landmark means' gradient keep · (dkl + dkl2)[segment] / length into dK (the one-node layer). ``partials``:
    dQ̃ as its per-program partials (b·h, programs, BLOCK_M, BLOCK_D), not yet summed."""
    b, h, m, d = q_land.shape
    n = k.shape[-2]
    q_land = q_land.contiguous()
    c = _lq_consts(q_land, backward=True)
    tiles = min(c.pop("tiles"), _cdiv(n, c["BLOCK_K"]))
    nprog = _cdiv(n, c["BLOCK_K"] * tiles)
    g = g.contiguous()
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dql_p = torch.empty(b * h, nprog, c["BLOCK_M"], c["BLOCK_D"], device=k.device, dtype=lse.dtype)
    keep, dkl, dkl2 = (seg[0], seg[1].contiguous(), seg[2].contiguous()) if seg is not None else (k, k, k)
    _lq_bwd_kernel[(b * h, nprog)](q_land, k, *k.stride(), v, *v.stride(), _bias_or(key_bias, k), g,
                                   lse.contiguous(), out.contiguous(), dk, *dk.stride(), dv, *dv.stride(), dql_p,
                                   keep, dkl, dkl2, h, n, m, d, d ** -0.5, TILES=tiles,  # HAS_SEG false: not read
                                   HAS_BIAS=key_bias is not None, HAS_SEG=seg is not None, **c)
    return dql_p if partials else _partial_sum(dql_p, (b, h, m, d)), dk, dv


class _LandmarkQueriesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_land, k, v, key_bias):
        out, lse, out_low = _lq_forward(q_land, k, v, key_bias)
        # The backward's rowsum(dW ⊙ W) from the fp32 W: from the bf16-rounded one, every score gradient of a row
        # shifts alike and the error adds up over n (dK, dQ̃ ~1.4× less accurate in a bf16 emulation).
        ctx.save_for_backward(q_land, k, v, key_bias, out, lse)
        return out_low

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        dql, dk, dv = _lq_backward(*ctx.saved_tensors, g)
        return dql, dk, dv, None


def landmark_queries_attention(q_land: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               key_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``SDPA(q_land, k, v, attn_mask=key_bias[:, None, None, :])``: the m ≤ 64 landmark queries (b, h, m, d) over
    all keys k, v (b, h, n, d, any strides), with an additive key bias (b, n), or None (no padding: nothing to
    read or add). A row whose every key carries the bias gives NaN here (SDPA: uniform weights); ``nystrom_fast``
    never passes one — it drops the bias for rows without any token."""
    _check()
    if q_land.shape[-2] > MAX_LANDMARKS:
        raise ValueError(f"landmark_queries_attention: at most {MAX_LANDMARKS} landmarks, got {q_land.shape[-2]}")
    return _LandmarkQueriesAttention.apply(q_land, k, v, key_bias)


def _lk_consts(q: torch.Tensor, m: int, backward: bool) -> dict:
    # Query rows per block: forward 64; backward 64 for 16-bit, 32 for 32/64-bit (at 64 the fp32 backward needs
    # 225 KB of shared memory and spills). 8 warps: no spills (ptxas, sm_90; 4 warps need 239 registers).
    # With "tiles" (the backward's row blocks a program) and the launch's warps, for the caller to take out.
    s = _launch("lk_backward_raw" if backward else "lk_forward_raw", q.dtype,
                rows=64 if not backward or q.element_size() <= 2 else 32, num_warps=8,
                **({"tiles": 8} if backward else {}))
    return dict(BLOCK_N=s["rows"], BLOCK_M=_block(m), BLOCK_D=_block(q.shape[-1]), PREC=_dot_precision(q.dtype),
                **({"tiles": s["tiles"]} if backward else {}), **_warps(s))


def lk_forward_raw(q, keep, k_land, zw, v=None, taps=None):
    """Pass 2's forward, no autograd, in q's layout; with ``v`` and ``taps`` (h, k) plus the conv of keep·v."""
    b, h, n, d = q.shape
    m = k_land.shape[-2]
    out = torch.empty_like(q)
    c = _lk_consts(q, m, backward=False)
    conv = taps is not None
    v = v if conv else q  # HAS_CONV false: never read
    ks = taps.shape[-1] if conv else 1
    _lk_fwd_kernel[(b * h, _cdiv(n, c["BLOCK_N"]))](q, *q.stride(), keep.contiguous(), k_land.contiguous(),
                                                    zw.contiguous(), out, *out.stride(), v, *v.stride(),
                                                    taps if conv else keep, h, n, m, d, d ** -0.5,
                                                    HAS_CONV=conv, KS=ks, WIN=_pow2(c["BLOCK_N"] + ks - 1), **c)
    return out


@_opaque(lambda q, keep, k_land, zw: torch.empty_like(q))
def _lk_forward(q: torch.Tensor, keep: torch.Tensor, k_land: torch.Tensor, zw: torch.Tensor) -> torch.Tensor:
    return lk_forward_raw(q, keep, k_land, zw)


@_opaque(lambda q, keep, k_land, zw, g: (torch.empty_like(q), k_land.new_empty(k_land.shape),
                                         zw.new_empty(zw.shape)))
def _lk_backward(q: torch.Tensor, keep: torch.Tensor, k_land: torch.Tensor, zw: torch.Tensor,
                 g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dkl, dzw = lk_backward_raw(q, keep, k_land, zw, g, dzw_dtype=zw.dtype)
    dkl = dkl.to(k_land.dtype)
    if dkl.untyped_storage().data_ptr() == dzw.untyped_storage().data_ptr():
        dzw = dzw.clone()  # the two halves of one sum over programs: a custom op's outputs may not alias
    return dq, dkl, dzw


def lk_backward_raw(q, keep, k_land, zw, g, dzw_dtype=None):
    """Pass 2's backward, no autograd: dQ (× keep, in q's layout), dK̃ (in the accumulation dtype) and d(ZW) (in
    ``dzw_dtype``, default the accumulation dtype)."""
    b, h, n, d = q.shape
    m = k_land.shape[-2]
    c = _lk_consts(q, m, backward=True)
    tiles = min(c.pop("tiles"), _cdiv(n, c["BLOCK_N"]))  # row blocks per program: fewer partial sums to add up
    nprog = _cdiv(n, c["BLOCK_N"] * tiles)
    acc = _acc_dtype(q.dtype)
    dzw_dtype = dzw_dtype or acc
    part_shape = (b * h, nprog, c["BLOCK_M"], c["BLOCK_D"])
    if nprog == 1:  # one program per (batch, head): its partials are the gradients, d(ZW) stored in its dtype
        dkl_p = torch.empty(part_shape, device=q.device, dtype=acc)
        dzw_p = torch.empty(part_shape, device=q.device, dtype=dzw_dtype)
    else:  # both gradients' partials in one buffer: one sum over the programs for the two
        parts = torch.empty((2,) + part_shape, device=q.device, dtype=acc)
        dkl_p, dzw_p = parts[0], parts[1]
    dq = torch.empty_like(q)
    _lk_bwd_kernel[(b * h, nprog)](q, *q.stride(), keep.contiguous(), k_land.contiguous(), zw.contiguous(), g,
                                   *g.stride(), dq, *dq.stride(), dkl_p, dzw_p, h, n, m, d, d ** -0.5,
                                   TILES=tiles, IS_F64=acc == torch.float64, **c)
    if nprog == 1:
        dkl, dzw = dkl_p[:, 0], dzw_p[:, 0]
    else:
        sums = parts.sum(2)
        dkl, dzw = sums[0], sums[1].to(dzw_dtype)
    return dq, dkl[:, :m, :d].reshape(b, h, m, d).contiguous(), dzw[:, :m, :d].reshape(b, h, m, d).contiguous()


class _LandmarkKeysAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keep, k_land, zw):
        ctx.save_for_backward(q, keep, k_land, zw)
        return _lk_forward(q, keep, k_land, zw)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        dq, dkl, dzw = _lk_backward(*ctx.saved_tensors, g)
        return dq, None, dkl, dzw


def landmark_keys_attention(q: torch.Tensor, keep: torch.Tensor, k_land: torch.Tensor,
                            zw: torch.Tensor) -> torch.Tensor:
    """``SDPA(q·keep, k_land, zw)``: every query over the m ≤ 64 landmark keys, for q (b, h, n, d) of any strides
    and keep (b, n). The gradient for q is returned × keep (q is masked inside)."""
    _check()
    if k_land.shape[-2] > MAX_LANDMARKS:
        raise ValueError(f"landmark_keys_attention: at most {MAX_LANDMARKS} landmarks, got {k_land.shape[-2]}")
    return _LandmarkKeysAttention.apply(q, keep, k_land, zw)


# ----------------------------------------------------------------------------------------------- segment means
def _empty(shape, like, dtype, device) -> torch.Tensor:
    """An output of ``shape``, laid out as ``like`` (any device: only its strides are read) or contiguous."""
    if like is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty_strided(shape, like.stride(), dtype=dtype, device=device)


def segment_means_raw(x: torch.Tensor, keep: torch.Tensor, m: int, x2: torch.Tensor | None = None):
    """The forward kernel alone (no autograd): means of x·keep over the m segments, (b, h, m, d); with ``x2`` (x's
    shape and dtype, any strides) the pair (x's, x2's) from one launch."""
    b, h, n, d = x.shape
    out = torch.empty(b, h, m, d, device=x.device, dtype=x.dtype)
    out2 = torch.empty_like(out) if x2 is not None else out
    seg_len = -(-n // m)
    s = _launch("segment_means_raw", x.dtype, rows=64, num_warps=4)
    block_n = max(1, min(s["rows"], _pow2(seg_len)))
    other = x2 if x2 is not None else x  # HAS_X2 false: never read
    _segmeans_kernel[(b * h, m)](x, *x.stride(), other, *other.stride(), keep.contiguous(), out, out2, h, n, m, d,
                                 NCHUNK=_cdiv(seg_len, block_n), BLOCK_N=block_n,
                                 BLOCK_D=_pow2(d), IS_F64=x.dtype == torch.float64, HAS_X2=x2 is not None,
                                 **_warps(s))
    return (out, out2) if x2 is not None else out


def segment_means_grad(g: torch.Tensor, keep: torch.Tensor, n: int, add: torch.Tensor | None = None,
                       mask_add: bool = False, like: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, g2: torch.Tensor | None = None,
                       g2_parts: torch.Tensor | None = None) -> torch.Tensor:
    """The input gradient of ``segment_means_raw`` for the landmark gradient g (b, h, m, d) (+ ``g2``, same shape,
    or + the sum over programs of ``g2_parts``, per-program partials (b·h, programs, ≥ m, ≥ d), when given), plus
    ``add`` (× keep if ``mask_add``) when given, in one pass; written with the strides of ``like`` (a tensor,
    e.g. on the meta device, of the input's layout; default contiguous), or into ``out`` (which may be ``add``:
    each element is read and then written by the same program)."""
    b, h, m, d = g.shape
    g = g.contiguous()
    if g2_parts is not None:
        g2 = g2_parts.contiguous()
        s2p, s2m = g2.stride(1), g2.stride(2)
        s2 = (g2.stride(0), s2p, s2m)
    elif g2 is not None:
        g2 = g2.contiguous()
        s2 = (m * d, 0, d)
    else:
        s2 = (0, 0, 0)
    gx = out if out is not None else _empty((b, h, n, d), like, g.dtype if add is None else add.dtype, g.device)
    s = _launch("segment_means_grad", gx.dtype, rows=32, num_warps=4)  # 64 rows × 64 columns: spills at 4 warps
    block_n = s["rows"]
    astr = add.stride() if add is not None else (0, 0, 0, 0)
    _segmeans_bwd_kernel[(b * h, _cdiv(n, block_n))](
        g, g2 if g2 is not None else g, *s2, keep.contiguous(), add if add is not None else g, *astr, gx,
        *gx.stride(), h, n, m, d, HAS_G2=g2 is not None, G2_PARTS=g2_parts.shape[1] if g2_parts is not None else 1,
        HAS_ADD=add is not None, MASK_ADD=mask_add, BLOCK_N=block_n, BLOCK_D=_pow2(d),
        IS_F64=g.dtype == torch.float64, **_warps(s))
    return gx


@_opaque(lambda x, keep, m: x.new_empty(x.shape[:-2] + (m, x.shape[-1])))
def _segment_means_forward(x: torch.Tensor, keep: torch.Tensor, m: int) -> torch.Tensor:
    return segment_means_raw(x, keep, m)


@_opaque(lambda g, keep, n: g.new_empty(g.shape[:-2] + (n, g.shape[-1])))
def _segment_means_backward(g: torch.Tensor, keep: torch.Tensor, n: int) -> torch.Tensor:
    return segment_means_grad(g, keep, n)


class _SegmentMeans(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, keep, m):
        ctx.save_for_backward(keep)
        ctx.n = x.shape[-2]
        return _segment_means_forward(x, keep, m)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients have no graph
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        return _segment_means_backward(g, keep, ctx.n), None, None


def segment_means_masked(x: torch.Tensor, keep: torch.Tensor, m: int) -> torch.Tensor:
    """``nystrom.segment_means(x * keep[:, None, :, None], m)`` for x (b, h, n, d) and keep (b, n)."""
    _check()
    return _SegmentMeans.apply(x, keep, m)


# ----------------------------------------------------------------------------------------------- depthwise conv
def conv_raw(x, keep, w, res=None, in_mask=True, out_mask=False, like=None, out=None, flip=False):
    """No autograd: ``res + out_keep·conv(in_keep·x)`` with taps w (h, k) (reversed if ``flip``: the input
    gradient's conv), written with ``like``'s strides (default: contiguous), or into ``out`` (which may be
    ``res``, not x: each element of res is read and then written by the same program, while x is read across
    rows)."""
    b, h, n, d = x.shape
    ks = w.shape[-1]
    dtype = x.dtype if res is None else res.dtype
    if out is None:
        out = _empty((b, h, n, d), like, dtype, x.device)
    s = _launch("conv_raw", x.dtype, rows=64, tiles=8, num_warps=8)  # 4 warps spill in fp32 (ptxas, sm_90)
    block_n = s["rows"]
    tiles = min(s["tiles"], _cdiv(n, block_n))  # row tiles per program: the band is built once for them
    # tf32 is not enough for an fp32 run (its ~1e-3 would show); 16-bit inputs use their own type in the product
    prec = {torch.float32: "tf32x3", torch.float64: "ieee"}.get(x.dtype, "tf32")
    rs = res.stride() if res is not None else (0, 0, 0, 0)
    _dwconv_kernel[(b * h, _cdiv(n, block_n * tiles))](
        x, *x.stride(), keep, w, res if res is not None else x, *rs, out, *out.stride(), h, n, d, KS=ks, FLIP=flip,
        IN_MASK=in_mask, OUT_MASK=out_mask, HAS_RES=res is not None, BLOCK_N=block_n,
        WIN=_pow2(block_n + ks - 1), BLOCK_D=_block(d), TILES=tiles,
        PREC=prec, **_warps(s))
    return out


def conv_weight_grad(v: torch.Tensor, keep: torch.Tensor, g: torch.Tensor, weight_shape) -> torch.Tensor:
    """Gradient of the Conv2d weight (h, 1, k, 1) of ``conv(v·keep)`` for the output gradient g (b, h, n, d)."""
    b, h, n, d = v.shape
    ks = weight_shape[2]
    g = g.contiguous()
    block_n = 64
    nblk = _cdiv(n, block_n)
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    part = torch.empty(b * h, nblk, ks, device=v.device, dtype=acc)
    _dwconv_wgrad_kernel[(b * h, nblk)](v, *v.stride(), keep, g, part, h, n, d, KS=ks, BLOCK_N=block_n,
                                        BLOCK_D=_pow2(d), IS_F64=acc == torch.float64)
    return part.reshape(b, h, nblk, ks).sum(dim=(0, 2)).reshape(weight_shape)


def wgrad_mm_tiles(element_size: int, ks: int) -> tuple[int, int]:
    """``conv_weight_grad_mm``'s rows a tile and tiles a program, 512 rows a program: 64-row tiles, but 16-row ones
    for 32/64-bit inputs and a conv wider than 64 taps (the shipped configs' 65), whose 64-row tile with its
    256-row window and 128 taps needs 290 KB of shared memory in fp32, over Hopper's 227 KB a block (16 rows: 142
    KB, no spills; ptxas for sm_90, bench/triton_compile_report.py)."""
    return (64, 8) if element_size <= 2 or ks <= 64 else (16, 32)


def conv_weight_grad_mm(v: torch.Tensor, keep: torch.Tensor, g: torch.Tensor, weight_shape) -> torch.Tensor:
    """``conv_weight_grad`` with one tensor-core product per 64-row tile and a diagonal gather (used by the
    ``NYSTROM_TRITON=all`` path: 0.27 ms on an H100 at 65,536 tokens against the shifted-load kernel's 0.47)."""
    b, h, n, d = v.shape
    ks = weight_shape[2]
    rows, tiles = wgrad_mm_tiles(v.element_size(), ks)
    s = _launch("conv_weight_grad_mm", v.dtype, rows=rows, tiles=tiles, num_warps=8)
    block_n, tiles, part = _taps_partials(v, ks, s)
    block_t = part.shape[-1]
    _dwconv_wgrad_mm_kernel[(b * h, part.shape[1])](
        v, *v.stride(), keep, g, *g.stride(), part, h, n, d, KS=ks, BLOCK_N=block_n,
        WIN=_pow2(block_n + block_t - 1), BLOCK_T=block_t, BLOCK_D=_block(d),
        TILES=tiles, PREC=_dot_precision(v.dtype), IS_F64=part.dtype == torch.float64, **_warps(s))
    return _taps_sum(part, b, h, ks).reshape(weight_shape)


def _taps_partials(v: torch.Tensor, ks: int, settings: dict) -> tuple[int, int, torch.Tensor]:
    """A taps'-gradient launch's rows a tile and tiles a program (from ``_launch``'s settings, tiles clamped to n),
    and its per-program partial sums to write, (b·h, programs, pow2(ks)) in the accumulation dtype."""
    b, h, n, _ = v.shape
    block_n = settings["rows"]
    tiles = min(settings["tiles"], _cdiv(n, block_n))
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    return block_n, tiles, torch.empty(b * h, _cdiv(n, block_n * tiles), _pow2(ks), device=v.device, dtype=acc)


def _taps_sum(part: torch.Tensor, b: int, h: int, ks: int) -> torch.Tensor:
    """The taps' gradient (h, ks): ``_taps_partials``' per-program partials summed over the batch and programs."""
    return part[..., :ks].reshape(b, h, part.shape[1], ks).sum(dim=(0, 2))


# The conv's backward in one pass (conv_backward_raw) for 16-bit inputs only: at 32/64 bits its tiles need 137–250
# KB of shared memory (fp32, conv 33–65) and spill (ptxas, sm_90), so there the two kernels run.
CONV_BACKWARD_ONE_PASS_MAX_BYTES = 2


def conv_backward_raw(v: torch.Tensor, keep: torch.Tensor, g: torch.Tensor, taps: torch.Tensor,
                      dv: torch.Tensor) -> torch.Tensor:
    """The conv's backward in one launch, no autograd: adds the input gradient ``conv_raw(g, keep, taps,
    in_mask=False, out_mask=True, flip=True)`` into ``dv`` in place and returns the taps' gradient (h, k) in the
    accumulation dtype, as ``conv_weight_grad_mm`` (same tiles, same products). v and g of one dtype."""
    b, h, n, d = v.shape
    ks = taps.shape[-1]
    # 64-row tiles spill at 8 warps in bf16 (52 bytes; more at 4), 32 do not (ptxas, sm_90); 16 tiles: 512 rows a
    # program, as the two kernels it replaces
    s = _launch("conv_backward_raw", v.dtype, rows=32, tiles=16, num_warps=8)
    block_n, tiles, part = _taps_partials(v, ks, s)
    block_t = part.shape[-1]
    _dwconv_bwd_kernel[(b * h, part.shape[1])](
        g, *g.stride(), v, *v.stride(), keep, taps, dv, *dv.stride(), part, h, n, d, KS=ks, BLOCK_N=block_n,
        WIN=_pow2(block_n + ks - 1), WIN_T=_pow2(block_n + block_t - 1), BLOCK_T=block_t, BLOCK_D=_block(d),
        TILES=tiles, PREC=_dot_precision(v.dtype), IS_F64=part.dtype == torch.float64, **_warps(s))
    return _taps_sum(part, b, h, ks)


def conv_taps(weight: torch.Tensor) -> torch.Tensor:
    """The Conv2d weight (h, 1, k, 1) as contiguous taps (h, k)."""
    return weight.reshape(weight.shape[0], weight.shape[2]).contiguous()


def _conv_forward_fake(v, keep, w, res):
    return v.new_empty(v.shape) if res is None else torch.empty_like(res)


@_opaque(_conv_forward_fake)
def _conv_forward(v: torch.Tensor, keep: torch.Tensor, w: torch.Tensor, res: Optional[torch.Tensor]) -> torch.Tensor:
    # With res (pass 2's output, in q's layout as SDPA writes it) the sum is written in res's layout: the model's
    # (b, n, h·d) reshape of the layer's output is then a view, not a copy.
    out = None if res is None else torch.empty_like(res)
    return conv_raw(v, keep.contiguous(), w, res, in_mask=True, out_mask=False, out=out)


@_opaque(lambda g, keep, w: g.new_empty(g.shape))
def _conv_input_grad(g: torch.Tensor, keep: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return conv_raw(g.contiguous(), keep.contiguous(), w, None, in_mask=False, out_mask=True, flip=True)


@_opaque(lambda v, keep, g, ks: v.new_empty((v.shape[1], 1, ks, 1), dtype=_acc_dtype(v.dtype)))
def _conv_weight_grad(v: torch.Tensor, keep: torch.Tensor, g: torch.Tensor, ks: int) -> torch.Tensor:
    return conv_weight_grad(v, keep.contiguous(), g, (v.shape[1], 1, ks, 1))


class _ConvAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, keep, weight, res):
        w = conv_taps(weight)
        ctx.save_for_backward(v, keep, w)
        ctx.has_res = res is not None
        return _conv_forward(v, keep, w, res)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients have no graph
    def backward(ctx, g):
        v, keep, w = ctx.saved_tensors
        # One contiguous copy for both kernels (in the model g is a transposed view of the (b, n, h·d) gradient);
        # res, pass 2's output, gets g as it came, in its own layout (what SDPA's backward expects of dO).
        g_dense = g.contiguous()
        dv = dw = None
        if ctx.needs_input_grad[0]:
            dv = _conv_input_grad(g_dense, keep, w).to(v.dtype)
        if ctx.needs_input_grad[2]:
            dw = _conv_weight_grad(v, keep, g_dense, w.shape[-1]).to(w.dtype)
        return dv, None, dw, (g if ctx.has_res else None)


def conv_add(v: torch.Tensor, keep: torch.Tensor, weight: torch.Tensor, res=None) -> torch.Tensor:
    """``res + Conv2d(h, h, (k, 1), padding=(k//2, 0), groups=h, bias=False)(v * keep)`` with the Conv2d's
    weight (h, 1, k, 1); v (b, h, n, d) any strides, keep (b, n)."""
    _check()
    if res is not None and res.shape != v.shape:
        raise ValueError("conv_add: res must have v's shape")
    return _ConvAdd.apply(v, keep, weight, res)


# ----------------------------------------------------------------------------------------------- the whole layer
# Training with NYSTROM_TRITON=all runs the layer (landmarks < n, m ≤ 64, init="original") as one autograd node,
# nystrom_fast._TritonNystrom, whose forward and backward are the two functions below: the kernels above in a fixed
# order, with no autograd inside. Q, K and V are each used twice (Q: pass 2 and the landmark means; K: pass 1 and
# the means; V: pass 1 and the conv); the backward writes each input's gradient once, the other use's share added
# in the same kernel: dQ = keep·(dQ_pass2 + the means' gradient) in the segment-means kernel, dK = dK_pass1 +
# keep·the means' gradient in pass 1's backward, dV = dV_pass1 + keep·conv_T(g) in the conv kernel. The landmarks'
# gradients from their two uses are added, in the accumulation dtype, by the kernels that read them. Under
# torch.compile both are custom ops, so the compiled step (CUDA graphs included) runs the same node.

# dK's segment-means share is added inside pass 1's backward for inputs of at most this many bytes per element, and
# by the segment-means backward kernel (one more pass over dK) for wider ones: with it, pass 1's fp32 backward
# spills (ptxas, sm_90, bench/triton_compile_report.py: 32 B per thread without), its bf16 one does not.
K_MEANS_GRAD_IN_PASS_1_MAX_BYTES = 2
# The one-node layer adds the conv inside pass 2's forward (HAS_CONV: the output written once; ptxas, sm_90: no
# spills in bf16 or fp32, 32 / 64 KB of shared memory); False: the conv kernel reads pass 2's output back and
# adds the conv, as timed on 2026-11-23 (bench/attention_speed.py's fast-triton-all-conv-apart).
CONV_IN_PASS_2 = True
# Pass 1's backward leaves dQ̃ as per-program partials. Up to this many (n ≤ 1,024 in bf16, 512 in fp32) the
# segment-means backward for dQ adds them itself, each of its programs reading the few landmark rows it needs from
# every partial; beyond, one sum launch first (the reads would grow with n / 256 per program).
DQ_PARTIALS_IN_SEGMENT_MEANS_MAX = 4


def _landmark_tensors(q, k, v, keep, key_bias, m):
    """Q̃, K̃, W (fp32, the only copy) and pass 1's log-sum-exp: the forward's first launches, which a recomputing
    backward (``NYSTROM_RECOMPUTE=1``) runs again through this same function — so the same values."""
    q_land, k_land = segment_means_raw(q, keep, m, x2=k)
    w, lse, _ = lq_forward_raw(q_land, k, v, key_bias, low=False)
    return q_land, k_land, w, lse


def _layer_forward_fake(q, k, v, keep, key_bias, taps, m, iters, precision, save, group):
    b, h, n, d = q.shape
    acc = _acc_dtype(q.dtype)
    land = (b, h, m, d)
    q_land = q.new_empty(land)
    return (torch.empty_like(q), q_land, k.new_empty(land), q.new_empty(land, dtype=acc),
            q.new_empty((b, h, m), dtype=acc), q.new_empty(land), q.new_empty((b, h), dtype=acc),
            q.new_empty((b, h, m), dtype=acc), q.new_empty(_kept_shape(q_land, iters, save), dtype=acc))


@_opaque(_layer_forward_fake)
def _layer_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                   key_bias: Optional[torch.Tensor], taps: Optional[torch.Tensor], m: int, iters: int,
                   precision: str, save: bool,
                   group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's output (in q's layout) and what its backward reads: Q̃, K̃, W (accumulation dtype, the only
    copy: the core rounds it to Z·W's dtype, the inputs', itself), pass 1's log-sum-exp, Z·W, the core's batch
    statistics and (``save``: for a backward that reads them) kept iterates."""
    q_land, k_land, w, lse = _landmark_tensors(q, k, v, keep, key_bias, m)
    stat, cols = _core_stats(q_land, k_land)
    zw, zs = _core_iterate(q_land, k_land, w, stat, iters, precision, has_w=True, keep=save, group=group,
                           zw_dtype=q.dtype)
    if taps is not None and CONV_IN_PASS_2:
        out = lk_forward_raw(q, keep, k_land, zw, v, taps)
    else:
        out = lk_forward_raw(q, keep, k_land, zw)
        if taps is not None:  # in place: each element of pass 2's output is read, then written, by one program
            conv_raw(v, keep, taps, out, in_mask=True, out_mask=False, out=out)
    return out, q_land, k_land, w, lse, zw, stat, cols, zs


def _layer_backward_fake(q, k, v, keep, key_bias, taps, stat, cols, q_land, k_land, w, lse, zw, zs, g, m, iters,
                         precision, group, need_q, need_v, need_taps):
    dtaps = stat.new_empty(taps.shape) if taps is not None and need_taps else stat.new_empty(0)
    return (torch.empty_like(q) if need_q else q.new_empty(0), torch.empty_like(k),
            torch.empty_like(v) if need_v else v.new_empty(0), dtaps)


@_opaque(_layer_backward_fake)
def _layer_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                    key_bias: Optional[torch.Tensor], taps: Optional[torch.Tensor], stat: torch.Tensor,
                    cols: torch.Tensor, q_land: Optional[torch.Tensor], k_land: Optional[torch.Tensor],
                    w: Optional[torch.Tensor], lse: Optional[torch.Tensor], zw: Optional[torch.Tensor],
                    zs: Optional[torch.Tensor], g: torch.Tensor, m: int, iters: int, precision: str, group: int,
                    need_q: bool, need_v: bool,
                    need_taps: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV in their inputs' layouts and d(taps) (h, k) in the accumulation dtype, from the output gradient g
    (any strides); an empty tensor for a gradient not asked for (dK is a by-product of dQ̃ and always made).
    Without the landmark tensors (q_land None: ``NYSTROM_RECOMPUTE=1``) it first recomputes them as the forward
    did — the same kernels on the same inputs, so the same values — and keeps the core's iterates for its
    backward, which then does not replay the iteration."""
    n = q.shape[-2]
    if q_land is None:
        q_land, k_land, w, lse = _landmark_tensors(q, k, v, keep, key_bias, m)
        zw, zs = _core_iterate(q_land, k_land, w, stat, iters, precision, has_w=True, keep=True, group=group,
                               always=True, zw_dtype=q.dtype)
    # d(ZW) in ZW's dtype, as the core's backward was timed: an fp32 one makes its bf16 kernel spill 348 B more
    # (ptxas, sm_90; 1,712 vs 1,364 B) for a gradient ~4% more accurate
    dq, dkl_pass2, dzw = lk_backward_raw(q, keep, k_land, zw, g, dzw_dtype=zw.dtype)
    dq_land, dk_land, dw = _core_reverse(q_land, k_land, w, stat, cols, zs, dzw, iters, precision,
                                         has_w=True, group=group, land_dtype=stat.dtype, dw_dtype=q.dtype)
    del zs  # kept iterates (recomputed ones included): not needed past the core's backward
    fuse_k = k.element_size() <= K_MEANS_GRAD_IN_PASS_1_MAX_BYTES
    dql_parts, dk, dv = lq_backward_raw(q_land, k, v, key_bias, w, lse, dw,
                                        seg=(keep, dk_land, dkl_pass2) if fuse_k else None, partials=True)
    if not fuse_k:
        segment_means_grad(dk_land, keep, n, add=dk, out=dk, g2=dkl_pass2)
    if need_q:
        if dql_parts.shape[1] <= DQ_PARTIALS_IN_SEGMENT_MEANS_MAX:  # pass 1's dQ̃ partials summed in the kernel
            segment_means_grad(dq_land, keep, n, add=dq, mask_add=True, out=dq, g2_parts=dql_parts)
        else:
            segment_means_grad(dq_land, keep, n, add=dq, mask_add=True, out=dq,
                               g2=_partial_sum(dql_parts, q_land.shape))
    dtaps = stat.new_empty(0)
    if (taps is not None and need_v and need_taps and g.dtype == v.dtype
            and v.element_size() <= CONV_BACKWARD_ONE_PASS_MAX_BYTES):  # one pass over g, v and dv
        dtaps = conv_backward_raw(v, keep, g, taps, dv)
    else:
        if taps is not None and need_v:
            conv_raw(g, keep, taps, dv, in_mask=False, out_mask=True, out=dv, flip=True)
        if taps is not None and need_taps:
            dtaps = conv_weight_grad_mm(v, keep, g, (taps.shape[0], 1, taps.shape[1], 1)).reshape(taps.shape)
    return dq if need_q else q.new_empty(0), dk, dv if need_v else v.new_empty(0), dtaps


def layer_forward(q, k, v, keep, key_bias, taps, m, iters, precision, save=True, init_rows=None):
    """The one-node layer's forward: (out, q_land, k_land, w, lse, zw, stat, cols, zs); ``save``: the landmark
    tensors will be kept for the backward (False with NYSTROM_RECOMPUTE=1: the iterates are not kept either);
    ``init_rows``: the init's max over groups of that many batch rows (``nystrom.iterative_pinv``)."""
    _check()
    return _layer_forward(q, k, v, keep, key_bias, taps, m, iters, precision, save,
                          init_group(*q.shape[:2], init_rows))


def layer_backward(q, k, v, keep, key_bias, taps, stat, cols, landmarks, g, *, m, iters, precision, need_q, need_v,
                   need_taps, init_rows=None):
    """dq, dk, dv, dtaps; ``landmarks`` = (q_land, k_land, w, lse, zw, zs) as the forward returned them, or None
    to recompute them here; ``init_rows`` as the forward's."""
    return _layer_backward(q, k, v, keep, key_bias, taps, stat, cols, *(landmarks or (None,) * 6), g, m, iters,
                           precision, init_group(*q.shape[:2], init_rows), need_q, need_v, need_taps)
