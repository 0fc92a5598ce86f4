"""Fast Nyström attention: the same function as ``nystrom.reference_forward``, written for CUDA.

The reference materialises three softmax kernels; here Nyström is two attention calls plus small pieces:

    W   = SDPA(Q̃, K, V, key padding bias)              landmark queries over all keys   (= kernel_3 @ V)
    A   = softmax(Q̃ K̃ᵀ / √d)   (fp32, m × m per head)   kernel_2
    Z   = pinv(A)  (the same Newton–Schulz-type iteration, same init, same number of steps)
    out = SDPA(Q, K̃, Z @ W)                             all queries over the landmark keys (= kernel_1 @ Z @ W)
        + depthwise conv along the sequence of V·mask

Equalities with the reference (checked in float64 by ``tests/test_nystrom_fast.py``):

* the reference scales Q and K by d^-1/4 each and then takes segment means; scaling commutes with means, so the
  landmarks here are means of the *unscaled* (masked) Q, K and SDPA's default scale 1/√d gives the same scores;
* masking: Q and K are zeroed at padded positions before the segment means (and Q stays zeroed for the second
  pass, as in kernel_1, which is not masked otherwise); the landmark pass masks padded keys with the same additive
  bias (the most negative finite number, so an all-padding row stays finite and uniform); the conv reads V·mask;
* ``(kernel_1 @ Z) @ (kernel_3 @ V)`` is evaluated as ``kernel_1 @ (Z @ (kernel_3 @ V))`` — associativity, so
  only rounding differs;
* the pseudo-inverse uses ``nystrom.pinv_init`` (for ``init="original"``: the max over the *whole batch*, or over
  each group of ``init_rows`` rows, a reduction before the per-matrix iteration) and then the same iteration
  ``Z ← ¼ Z (13I − AZ(15I − AZ(7I − AZ)))`` written as four fused batched products per step
  (``P = AZ``; ``U = 7P − P·P``; ``W = 15P − P·U``; ``Z ← 13/4 Z − ¼ Z·W``), again only rounding differs;
* when ``num_landmarks >= n`` it is exact masked softmax attention, as in the reference.

The landmark pieces (A, Z, Z @ W) are computed in at least float32 whatever the input dtype: the iteration is
not stable in bf16, and they are tiny (m × m and m × d per head).

On CUDA, when Triton is importable, the segment means, the pseudo-inverse iteration and the conv (+ residual add)
run as Triton kernels (``nystrom_triton``); otherwise, and on CPU, as PyTorch ops (the conv as a grouped conv1d,
which the H100 profile found faster than the reference's Conv2d). ``NYSTROM_TRITON`` chooses (``triton_mode``):
0 = none, 1 = those kernels (default), all = also the attention-pass kernels, the landmark core and the one-node
training backward (faster for bf16 attention on an H100; docs/performance.md). ``NYSTROM_OVERLAP=1``
(``overlap_mode``, default 0: slower on an H100) computes Z apart from Z @ W, on a second CUDA stream beside the
landmark pass. ``NYSTROM_RECOMPUTE=1`` (``recompute_mode``, default 0) makes ``all``'s training layer recompute
its landmark-sized tensors in the backward instead of keeping them (memory for time).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from .nystrom import AttentionSettingError, depthwise_conv, pinv_init, segment_means


TRITON_MODES = ("0", "1", "all")
# The Triton kernels' limits; beyond them the fast path runs on PyTorch ops.
MAX_LANDMARKS = 64  # 64×64 fp32 tiles already fill the registers of 8 warps
# Tiles are sized for head_dim ≤ 64: at 128, fp32 backward and conv kernels need 300+ KB of shared memory, over
# the H100's 227 KB (triton.compile for sm_90 on the CPU machine).
MAX_HEAD_DIM = 64


def triton_mode() -> str:
    """``NYSTROM_TRITON``: "0" no Triton kernels; "1" (default) segment means, pseudo-inverse and conv kernels;
    "all" also both attention passes, the landmark core and the one-node training backward. Both are tested and
    timed on an H100: "all" is faster with bf16 attention, slower end-to-end with the shipped fp32-attention
    config at n = 512 (host time; docs/performance.md), hence the default."""
    mode = os.environ.get("NYSTROM_TRITON", "1")
    if mode not in TRITON_MODES:
        raise AttentionSettingError(f"NYSTROM_TRITON: expected one of {', '.join(TRITON_MODES)}, got {mode!r}")
    return mode


def _triton_default(x: torch.Tensor) -> bool:
    if triton_mode() == "0":
        return False
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not (x.is_cuda or interpret):
        return False
    from . import nystrom_triton
    if not nystrom_triton.available():
        return False
    if not x.is_cuda:
        return True  # the interpreter runs the kernels on CPU tensors
    return nystrom_triton.fits_device(x.device.index, x.element_size())


def pinv_iterate(a: torch.Tensor, z: torch.Tensor, num_iterations: int) -> torch.Tensor:
    """The paper's iteration from ``z``, each step as one bmm and three baddbmm (4 launches instead of 8)."""
    shape = a.shape
    a = a.reshape(-1, shape[-2], shape[-1])
    z = z.reshape(-1, shape[-1], shape[-2])
    for _ in range(num_iterations):
        p = torch.bmm(a, z)
        u = torch.baddbmm(p, p, p, beta=7.0, alpha=-1.0)           # P (7I − P)
        w = torch.baddbmm(p, p, u, beta=15.0, alpha=-1.0)          # P (15I − U)
        z = torch.baddbmm(z, z, w, beta=13.0 / 4, alpha=-1.0 / 4)  # ¼ Z (13I − W)
    return z.reshape(shape[:-2] + (shape[-1], shape[-2]))


def pinv(a: torch.Tensor, num_iterations: int = 6, init: str = "original", use_triton: bool = False,
         precision: str = "ieee", init_rows: Optional[int] = None) -> torch.Tensor:
    z0 = pinv_init(a, init, init_rows)
    if use_triton and a.shape[-1] <= MAX_LANDMARKS:
        from .nystrom_triton import pinv_iterate as triton_pinv_iterate
        return triton_pinv_iterate(a, z0, num_iterations, precision=precision)
    return pinv_iterate(a, z0, num_iterations)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], *, num_landmarks: int,
            pinv_iterations: int = 6, init: str = "original", conv_weight: Optional[torch.Tensor] = None,
            use_triton: Optional[bool] = None, pinv_precision: str = "auto",
            fused_backward: Optional[bool] = None, init_rows: Optional[int] = None) -> torch.Tensor:
    """Nyström attention on (b, h, n, d) inputs with a (b, n) key padding mask (1 = token, 0 = padding), or
    ``mask=None`` for rows without padding (pretraining's full-length rows): then no mask multiplies, no key
    bias, and SDPA may pick FlashAttention — the same function as an all-ones mask, one Q-sized copy fewer.

    ``conv_weight`` is the reference's Conv2d weight (h, 1, k, 1) or None. ``use_triton`` defaults to
    Triton on CUDA when importable. ``pinv_precision`` is Triton's ``input_precision`` for the pinv kernel's
    products: "auto" = "tf32" for 16-bit inputs (its ~1e-3 error is below bf16's; checked by emulation in
    docs/performance.md), "tf32x3" (near fp32) for fp32 inputs; or "ieee" / "tf32x3" / "tf32" explicitly.
    ``fused_backward`` (Triton only; default: ``NYSTROM_TRITON=all``): in training, run the layer as one autograd
    node (``_TritonNystrom``) where the attention kernels apply (m ≤ 64, ``init="original"``, no
    ``NYSTROM_OVERLAP``); False: the per-kernel autograd path. ``init_rows``: ``init="original"``'s max over
    each group of that many batch rows instead of the whole batch (``nystrom.iterative_pinv``).
    """
    b, h, n, d = q.shape
    if use_triton is None:
        use_triton = d <= MAX_HEAD_DIM and _triton_default(q)
    elif use_triton and d > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels support head_dim <= {MAX_HEAD_DIM}, got {d} (use_triton=False uses "
                         f"PyTorch ops)")
    if pinv_precision == "auto":
        pinv_precision = "tf32" if q.element_size() <= 2 else "tf32x3"
    dtype = q.dtype
    keep = bias = None  # no padding: nothing to mask
    if mask is not None:
        keep = mask.to(dtype)
        # The reference's additive key bias. A row with no token at all gets no bias: its (zeroed) queries then
        # score 0 on every key, which is the reference's uniform row — but with a log-sum-exp that SDPA's backward
        # can use (min + log n rounds to min, which would make every probability 1 in the backward).
        has_token = keep.amax(dim=-1, keepdim=True)
        bias = (1.0 - keep) * has_token * torch.finfo(dtype).min               # (b, n), added to key scores
    masked = (lambda t: t) if keep is None else (lambda t: t * keep[:, None, :, None])  # noqa: E731
    # The kernels read a (b, n) keep vector whether or not there is padding (b·n bytes: nothing to save).
    kernel_keep = (keep if keep is not None else _all_ones(b, n, q)) if use_triton else None
    all_kernels = use_triton and triton_mode() == "all"
    attention_kernels = all_kernels and num_landmarks <= MAX_LANDMARKS
    if fused_backward is None:
        fused_backward = all_kernels
    # Pass 2's kernel, like the others, takes the (b, n) keep vector whether or not there is padding; pass 1's
    # adds the key bias only where there is one.
    pass_keep, pass_bias = (kernel_keep if attention_kernels else keep), bias
    landmark_args = (pass_keep, pass_bias, pinv_iterations, init, attention_kernels, use_triton, pinv_precision,
                     init_rows)

    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if num_landmarks >= n:
        out = F.scaled_dot_product_attention(masked(q), masked(k), v, attn_mask=_key_bias(bias))
    elif fused_backward and attention_kernels and init == "original" and not overlap_mode() and training:
        # Training with the kernels: one autograd node whose backward writes dq, dk, dv once each (custom ops
        # under torch.compile, so the compiled step runs it too).
        return _TritonNystrom.apply(q, k, v, conv_weight, kernel_keep, bias, num_landmarks, pinv_iterations,
                                    pinv_precision, init_rows)
    else:
        if training and all_kernels and recompute_mode():  # asked for, but this layer cannot: say so
            warnings.warn(f"NYSTROM_RECOMPUTE=1 does not apply to this layer (num_landmarks={num_landmarks}, "
                          f"init={init!r}{', fused_backward=False' if not fused_backward else ''}): it runs the "
                          f"per-kernel path, which keeps its landmark tensors; only the one-node layer "
                          f"(num_landmarks <= {MAX_LANDMARKS}, init='original') recomputes them", stacklevel=2)
        if use_triton:
            from .nystrom_triton import segment_means_masked
            q_land = segment_means_masked(q, kernel_keep, num_landmarks)
            k_land = segment_means_masked(k, kernel_keep, num_landmarks)
        else:
            q_land = segment_means(masked(q), num_landmarks)
            k_land = segment_means(masked(k), num_landmarks)
        out = _landmark_attention(q, k, v, q_land, k_land, *landmark_args)

    if conv_weight is not None:
        if use_triton:
            from .nystrom_triton import conv_add
            return conv_add(v, kernel_keep, conv_weight, out)
        out = out + depthwise_conv(masked(v), conv_weight)
    return out


_ALL_ONES: dict = {}


def _all_ones(b: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """A (b, n) keep vector of ones in ``like``'s dtype and device, made once per shape and shared by every layer
    and step: a fill launch fewer per layer. The kernels only read it. Under torch.compile, or for a tensor that is
    not a plain one (a FakeTensor when shapes are traced), a fresh one, never cached."""
    if torch.compiler.is_compiling() or type(like) is not torch.Tensor:
        return like.new_ones(b, n)
    # inference tensors (made under torch.inference_mode) cannot be saved for a backward: kept apart
    key = (b, n, like.dtype, like.device, torch.is_inference_mode_enabled())
    ones = _ALL_ONES.get(key)
    if ones is None:
        if len(_ALL_ONES) >= 16:  # a few shapes in a run (training, dev evaluation): never grows without bound
            _ALL_ONES.clear()
        ones = _ALL_ONES[key] = like.new_ones(b, n)
    return ones


def _key_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """SDPA's attn_mask for a (b, n) additive key bias; None (no padding) leaves SDPA free to use FlashAttention."""
    return None if bias is None else bias[:, None, None, :]


def _landmark_attention(q, k, v, q_land, k_land, keep, bias, pinv_iterations, init, attention_kernels, use_triton,
                        pinv_precision, init_rows=None):
    """SDPA(Q·keep, K̃, pinv(softmax(Q̃K̃ᵀ/√d)) · SDPA(Q̃, K, V, bias)); the m × m pieces in ≥ fp32.

    With ``attention_kernels`` (m ≤ 64) both passes are Triton kernels: pass 1 (the m landmark queries over all
    keys) ``landmark_queries_attention``, split over keys; pass 2 (every query over the m landmark keys)
    ``landmark_keys_attention``, which masks Q itself and spreads the n-long reductions of its backward over
    many programs; and for ``init="original"`` the m × m middle is ``landmark_core`` (2 + 2 launches instead of
    ~30 operators). Otherwise both passes are SDPA (pass 2 on the masked Q), and ``keep`` and ``bias`` are None
    when there is no padding."""
    # Padded keys carry the bias, so K need not be zeroed here (q·k is far below the bias's rounding unit).
    split = overlap_mode()
    side = _fork(q_land) if split else None  # before pass 1 is queued, or the side stream would wait for it
    if attention_kernels:
        from .nystrom_triton import landmark_queries_attention
        w = landmark_queries_attention(q_land, k, v, bias)
    else:
        w = F.scaled_dot_product_attention(q_land, k, v, attn_mask=_key_bias(bias))
    if split:
        # Z needs only the landmarks: on the side stream it runs beside pass 1, and (autograd runs each backward
        # op on its forward's stream) its backward beside pass 1's. Made after pass 1, so autograd's ready queue
        # (latest node first) queues the long iteration's backward before pass 1's.
        # Views made here, so autograd nodes on this stream receive the side stream's gradients of the landmarks
        # (a leaf first used on the side stream would get its gradient accumulator there: the fused node's are)
        q_side, k_side = q_land.view_as(q_land), k_land.view_as(k_land)
        with _on(side):
            z = landmark_pinv(q_side, k_side, pinv_iterations, init, use_triton, pinv_precision,
                              core_kernel=attention_kernels, init_rows=init_rows)
        _join(side, z, reads=(q_land, k_land))
        zw = times_w(z, w)
    else:
        zw = landmark_middle(q_land, k_land, w, pinv_iterations, init, use_triton, pinv_precision,
                             core_kernel=attention_kernels, init_rows=init_rows)
    if attention_kernels:
        from .nystrom_triton import landmark_keys_attention
        return landmark_keys_attention(q, keep, k_land, zw)
    return F.scaled_dot_product_attention(q if keep is None else q * keep[:, None, :, None], k_land, zw)


def landmark_middle(q_land, k_land, w, pinv_iterations, init, use_triton, pinv_precision, core_kernel=False,
                    init_rows=None):
    """pinv(softmax(Q̃K̃ᵀ/√d)) @ W, in W's dtype, computed in ≥ fp32 even under autocast (the iteration is not
    stable in bf16). ``core_kernel`` (m ≤ 64, ``init="original"``): the Triton ``landmark_core``, 2 + 2 launches;
    otherwise PyTorch ops around the pinv iteration (a Triton kernel if ``use_triton``)."""
    if core_kernel and init == "original":
        from .nystrom_triton import landmark_core
        return landmark_core(q_land, k_land, w, pinv_iterations, pinv_precision, init_rows)
    return times_w(landmark_pinv(q_land, k_land, pinv_iterations, init, use_triton, pinv_precision,
                                 init_rows=init_rows), w)


def landmark_pinv(q_land, k_land, pinv_iterations, init, use_triton, pinv_precision, core_kernel=False,
                  init_rows=None):
    """Z = pinv(softmax(Q̃K̃ᵀ/√d)), (b, h, m, m) in ≥ fp32 (autocast off); ``core_kernel``: the Triton
    ``landmark_pinv`` (the core's kernels without the product with W)."""
    if core_kernel and init == "original":
        from . import nystrom_triton
        return nystrom_triton.landmark_pinv(q_land, k_land, pinv_iterations, pinv_precision, init_rows)
    work = torch.promote_types(q_land.dtype, torch.float32)
    with torch.autocast(q_land.device.type, enabled=False):
        scores = q_land.to(work) @ k_land.to(work).transpose(-1, -2) * (q_land.shape[-1] ** -0.5)
        a = torch.softmax(scores, dim=-1)
        return pinv(a, pinv_iterations, init, use_triton=use_triton, precision=pinv_precision, init_rows=init_rows)


def times_w(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Z @ W in Z's (≥ fp32) dtype, returned in W's."""
    with torch.autocast(w.device.type, enabled=False):
        return (z @ w.to(z.dtype)).to(w.dtype)


# ----------------------------------------------------------------------------------------------- side stream
OVERLAP_MODES = ("0", "1")
_SIDE_STREAMS: dict = {}


def overlap_mode() -> bool:
    """``NYSTROM_OVERLAP=1``: compute Z = pinv(kernel_2) apart from Z·W, on a second CUDA stream beside pass 1,
    forward and backward. Can pay where pass 1 leaves SMs idle and the iteration's few programs sit between the
    passes: long n, small batch (at 65,536 tokens and batch 1, 12 matrices on 12 of 132 SMs; their device time
    is estimated at ~0.1–0.2 ms fwd+bwd, docs/performance.md). Default 0: on an H100 it was slower from
    n = 4096 on (attention 4.36 vs 2.98 ms at 65,536; 3% faster at 512) and in training. On CPU (and under
    torch.compile or CUDA-graph capture) the split form runs on one stream: same function."""
    mode = os.environ.get("NYSTROM_OVERLAP", "0")
    if mode not in OVERLAP_MODES:
        raise AttentionSettingError(f"NYSTROM_OVERLAP: expected one of {', '.join(OVERLAP_MODES)}, got "
                                    f"{mode!r}")
    return mode == "1"


RECOMPUTE_MODES = ("0", "1")


def recompute_mode() -> bool:
    """``NYSTROM_RECOMPUTE=1``: the one-node training layer (``NYSTROM_TRITON=all``) keeps only q, k, v and the
    core's batch statistics for its backward, which recomputes the landmarks, W and Z·W (3–4 launches and an
    n-long read of q, k, v more per layer) — activation memory then at or below the softmax layer's, which keeps
    its log-sum-exp (b·h·n numbers) besides q, k, v and the output. Default 0: the landmark-sized tensors (Q̃, K̃,
    W, Z·W: 1/8 of a q-sized tensor each at n = 512 and 64 landmarks, 1/64 at 4096) are kept. Only meaningful
    with ``NYSTROM_TRITON=all`` and without ``NYSTROM_OVERLAP=1``: any other combination is an error, not a
    setting silently ignored; a training layer the one-node path does not cover (more than 64 landmarks,
    ``init="exact"``, ``fused_backward=False``) warns."""
    mode = os.environ.get("NYSTROM_RECOMPUTE", "0")
    if mode not in RECOMPUTE_MODES:
        raise AttentionSettingError(f"NYSTROM_RECOMPUTE: expected one of {', '.join(RECOMPUTE_MODES)}, got "
                                    f"{mode!r}")
    if mode == "1" and (triton_mode() != "all" or overlap_mode()):
        raise AttentionSettingError("NYSTROM_RECOMPUTE=1 applies to the one-node layer of NYSTROM_TRITON=all "
                                    "without NYSTROM_OVERLAP=1; here NYSTROM_TRITON="
                                    f"{triton_mode()}, NYSTROM_OVERLAP={os.environ.get('NYSTROM_OVERLAP', '0')}")
    return mode == "1"


# ------------------------------------------------------------------------------------------- launch settings
# The Triton wrappers over the n-long tensors and the settings each takes (nystrom_triton._launch), besides
# num_stages (Triton's default otherwise): rows a tile, tiles a program, partials a load, warps.
LAUNCH_SETTINGS = {
    "segment_means_raw": ("rows", "num_warps"),
    "segment_means_grad": ("rows", "num_warps"),
    "lq_forward_raw": ("rows", "tiles", "num_warps"),
    "lq_combine": ("rows", "parts", "num_warps"),
    "lq_backward_raw": ("rows", "tiles", "num_warps"),
    "lk_forward_raw": ("rows", "num_warps"),
    "lk_backward_raw": ("rows", "tiles", "num_warps"),
    "conv_raw": ("rows", "tiles", "num_warps"),
    "conv_weight_grad_mm": ("rows", "tiles", "num_warps"),
    "conv_backward_raw": ("rows", "tiles", "num_warps"),
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
# Rows are tile sides (powers of two), at least tl.dot's 16 — but the combine's are landmark rows, no product
MIN_ROWS = {"lq_combine": 1}
# ... and at most 1024, or 512 where a tile of rows meets the conv's window of pow2(rows + conv - 1) rows: Triton
# refuses a tensor over 2^20 elements (1024 x 2048 would be one at any conv above 1)
MAX_ROWS = {"conv_raw": 512, "conv_weight_grad_mm": 512, "conv_backward_raw": 512, "lk_forward_raw": 512}


def launch_settings() -> dict:
    """``NYSTROM_LAUNCH_SETTINGS``: a JSON file of launch settings, by the inputs' dtype, that replace the
    wrappers' own, e.g. ``{"bf16": {"conv_raw": {"rows": 32, "num_stages": 2}}}`` — what
    ``bench/kernel_settings.py --best FILE`` writes after timing them on a GPU (settings differ by dtype: fp32
    tiles of a bf16-tuned size can overflow shared memory); {} when unset. Read once per path; a bad file is an
    error naming the file and the key. Rows and tiles are still clamped to short sequences, as the wrappers' own.
    An entry's optional ``"when"`` names the wrapper's own settings where it was swept, e.g. ``{"rows": 128, "when":
    {"rows": 64, "tiles": 8}}``: where the wrapper chooses otherwise (another conv width or dtype size), the entry
    was never timed there — it may not even fit the shared memory — and is not applied (a warning says so)."""
    path = os.environ.get("NYSTROM_LAUNCH_SETTINGS")
    return _read_launch_settings(path) if path else {}


def _pow2_at_least(value: int, low: int) -> bool:
    return value >= low and value & (value - 1) == 0


@functools.lru_cache(maxsize=4)
def _read_launch_settings(path: str) -> dict:
    where = f"NYSTROM_LAUNCH_SETTINGS={path}"
    try:
        with open(path) as f:
            settings = json.load(f)
    except OSError as exc:
        raise AttentionSettingError(f"{where}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise AttentionSettingError(f"{where}: not JSON (line {exc.lineno}: {exc.msg})") from None
    names = ", ".join(DTYPE_NAMES.values())
    if not isinstance(settings, dict):
        raise AttentionSettingError(f"{where}: expected an object of dtypes ({names}), got {type(settings).__name__}")
    for dtype, wrappers in settings.items():
        if dtype not in DTYPE_NAMES.values():
            raise AttentionSettingError(f"{where}: no dtype {dtype!r}; settings go under the inputs' dtype: {names}")
        if not isinstance(wrappers, dict):
            raise AttentionSettingError(f"{where}: {dtype!r} must be an object of wrappers, got {wrappers!r}")
        for wrapper, given in wrappers.items():
            _check_launch_setting(where, dtype, wrapper, given)
    return settings


def _check_launch_setting(where: str, dtype: str, wrapper: str, given) -> None:
    if wrapper not in LAUNCH_SETTINGS:
        raise AttentionSettingError(f"{where}: no wrapper {dtype}.{wrapper}; the wrappers are "
                                    f"{', '.join(LAUNCH_SETTINGS)}")
    if not isinstance(given, dict):
        raise AttentionSettingError(f"{where}: {dtype}.{wrapper} must be an object of settings, got {given!r}")
    allowed = LAUNCH_SETTINGS[wrapper] + ("num_stages",)
    when = given.get("when", {})  # the wrapper's own settings where it was swept (kernel_settings.py writes it)
    if not isinstance(when, dict):
        raise AttentionSettingError(f"{where}: {dtype}.{wrapper}.when must be an object of the wrapper's own "
                                    f"settings, got {when!r}")
    for key, value in when.items():
        if key not in LAUNCH_SETTINGS[wrapper] or isinstance(value, bool) or not isinstance(value, int):
            raise AttentionSettingError(f"{where}: {dtype}.{wrapper}.when.{key} = {value!r}: expected one of the "
                                        f"wrapper's own settings ({', '.join(LAUNCH_SETTINGS[wrapper])}), an integer")
    for key, value in given.items():
        if key == "when":
            continue
        if key not in allowed:
            raise AttentionSettingError(f"{where}: {dtype}.{wrapper} has no setting {key!r}; it has "
                                        f"{', '.join(allowed)}")
        name = f"{dtype}.{wrapper}.{key} = {value!r}"
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AttentionSettingError(f"{where}: {name}: expected a positive integer")
        low = MIN_ROWS.get(wrapper, 16) if key == "rows" else 1
        high = MAX_ROWS.get(wrapper, 1024) if key == "rows" else 1024
        if key in ("rows", "parts") and not (_pow2_at_least(value, low) and value <= high):
            why = " and the conv's window beside it" if high < 1024 else ""
            raise AttentionSettingError(f"{where}: {name}: expected a power of two from {low} to {high} "
                                        f"(a tile side{why})")
        if key == "num_warps" and value not in (1, 2, 4, 8, 16):
            raise AttentionSettingError(f"{where}: {name}: expected 1, 2, 4, 8 or 16")
    # Triton 3.6 compiles pass 1's fp32 backward at 8 warps wrong on an H100 (docs/performance.md)
    if wrapper == "lq_backward_raw" and dtype in ("fp32", "fp64") and given.get("num_warps", 4) > 4:
        raise AttentionSettingError(f"{where}: {dtype}.lq_backward_raw.num_warps = {given['num_warps']}: Triton "
                                    f"3.6 miscompiles pass 1's {dtype} backward above 4 warps for sm_90")


def describe_switches(device: torch.device) -> str:
    """The Nyström formulation and switches a run on ``device`` uses, for its startup line (a job's log then says
    which kernels produced its numbers)."""
    from .nystrom import use_fast_path
    if not use_fast_path(torch.empty(0, device=device)):
        return f"Nyström attention: the reference formulation on {device.type}"
    settings = os.environ.get("NYSTROM_LAUNCH_SETTINGS")
    return (f"Nyström attention: fast path, NYSTROM_TRITON={triton_mode()}, NYSTROM_OVERLAP={int(overlap_mode())}, "
            f"NYSTROM_RECOMPUTE={int(recompute_mode())}"
            + (f", NYSTROM_LAUNCH_SETTINGS={settings} ({json.dumps(launch_settings(), sort_keys=True)})"
               if settings else ""))


def _fork(x: torch.Tensor):
    """A side stream of x's device that waits for the current stream's work so far, or None where streams are
    not used (CPU; torch.compile, which would need to trace them; graph capture, kept to one stream)."""
    if not x.is_cuda or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return None
    side = _SIDE_STREAMS.get(x.device)
    if side is None:
        # high priority: the iteration's few long programs start as soon as an SM frees, not after pass 1's many
        side = _SIDE_STREAMS[x.device] = torch.cuda.Stream(x.device, priority=-1)
    side.wait_stream(torch.cuda.current_stream(x.device))
    return side


def _on(side):
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def _join(side, out: torch.Tensor, reads):
    """The current stream waits for the side stream; the caching allocator is told which tensors cross streams
    (inputs made here and read there, the output made there and used here), so none is reused too early."""
    if side is None:
        return
    main = torch.cuda.current_stream(out.device)
    main.wait_stream(side)
    for t in reads:
        t.record_stream(side)
    out.record_stream(main)


class _TritonNystrom(torch.autograd.Function):
    """The Nyström layer (landmarks < n, m ≤ 64, ``init="original"``) with the Triton kernels, as one autograd node:
    ``nystrom_triton.layer_forward`` / ``layer_backward``, every kernel in a fixed order with no autograd inside.

    Q, K and V are each used twice (Q: masked queries of pass 2 and the landmark means; K: pass 1 and the landmark
    means; V: pass 1 and the conv), so plain autograd writes two input-sized gradients per input and adds them,
    plus mask multiplies — ~1.5–2 ms of "glue" per layer at 65,536 tokens on the H100 (docs/performance.md). Here
    each input gradient is written once, the other use's share added in the same kernel; what the backward reads
    is saved as any node's is (so activation checkpointing and ``retain_graph`` work as usual).
    """

    @staticmethod
    def forward(ctx, q, k, v, conv_weight, keep, key_bias, m, iters, precision, init_rows):
        from . import nystrom_triton as nt
        keep = keep.contiguous()
        taps = None if conv_weight is None else nt.conv_taps(conv_weight)
        # The output is in q's layout, as SDPA's is: the model's (b, n, h·d) reshape is then a view, not a copy
        # that the output projection would keep besides this tensor.
        save = not recompute_mode()
        out, q_land, k_land, w, lse, zw, stat, cols, zs = nt.layer_forward(q, k, v, keep, key_bias, taps, m, iters,
                                                                            precision, save, init_rows)
        # NYSTROM_RECOMPUTE=1: only the inputs and the core's batch statistics (b·h·(m + 1) numbers) are kept; the
        # landmark-sized tensors die here and the backward recomputes them.
        landmarks = (q_land, k_land, w, lse, zw, zs) if save else ()
        ctx.save_for_backward(q, k, v, keep, key_bias, taps, stat, cols, *landmarks)
        ctx.m, ctx.iters, ctx.precision, ctx.init_rows = m, iters, precision, init_rows
        if conv_weight is not None:
            ctx.weight_shape, ctx.weight_dtype = conv_weight.shape, conv_weight.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward (the fused kernels are not differentiable)
    def backward(ctx, g):
        from . import nystrom_triton as nt
        need_q, need_k, need_v, need_w = ctx.needs_input_grad[:4]
        # g as it comes (every kernel takes strides): in the model, a view of the (b, n, h·d) gradient.
        q, k, v, keep, key_bias, taps, stat, cols, *landmarks = ctx.saved_tensors
        dq, dk, dv, dtaps = nt.layer_backward(q, k, v, keep, key_bias, taps, stat, cols, landmarks or None, g,
                                              m=ctx.m, iters=ctx.iters, precision=ctx.precision, need_q=need_q,
                                              need_v=need_v, need_taps=need_w, init_rows=ctx.init_rows)
        dw = dtaps.reshape(ctx.weight_shape).to(ctx.weight_dtype) if need_w else None
        return (dq if need_q else None, dk if need_k else None, dv if need_v else None, dw,
                None, None, None, None, None, None)
