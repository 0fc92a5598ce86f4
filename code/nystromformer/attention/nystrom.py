"""Nyström attention (Xiong et al., AAAI 2021), faithful to the authors' code.

softmax(QKᵀ/√d) V is approximated by  softmax(Q K̃ᵀ) · pinv(softmax(Q̃ K̃ᵀ)) · softmax(Q̃ Kᵀ) V  where Q̃, K̃ are
``num_landmarks`` segment means of Q and K, and pinv is the iterative Moore–Penrose pseudo-inverse.
Q and K are each scaled by d^-1/4 (so their product carries the usual 1/√d).

Padding: as in the authors' code, padded positions are zeroed in Q, K (before the segment means) and in
V (before the conv), and padded keys are masked out of softmax(Q̃ Kᵀ). So the *contents* of padded
positions never change real tokens' outputs, but the *amount* of padding does (it shifts the segment
boundaries and dilutes the landmark means): that is inherent to segment-mean landmarks over a padded
length. When ``num_landmarks >= seq_len`` the layer computes exact softmax attention.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserError
from . import key_padding_mask, register


def segment_means(x: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Means of ``num_segments`` contiguous segments along dim -2.

    When the length n is not a multiple, segment i covers positions p with floor(p·m/n) = i, so
    segment lengths differ by at most one (the authors' April 2021 extension, instead of a crash).
    """
    n = x.shape[-2]
    if n % num_segments == 0:
        return x.reshape(*x.shape[:-2], num_segments, n // num_segments, x.shape[-1]).mean(dim=-2)
    seg_id = torch.arange(n, device=x.device) * num_segments // n
    # segment i is [ceil(i·n/m), ceil((i+1)·n/m)): its length by arithmetic, not bincount, which reads values back
    # to the host on CUDA (a synchronization, and no CUDA-graph capture)
    starts = (torch.arange(num_segments + 1, device=x.device) * n + num_segments - 1) // num_segments
    counts = starts.diff().to(x.dtype)
    if torch.compiler.is_compiling():
        # As one (m, n) averaging matrix: Inductor (torch 2.13, CPU, two threads or more) generates index_add_'s
        # scatter in the training graph with the wrong head stride and corrupts the heap (n not a multiple of m,
        # with a mask and the conv). Equal to the eager form to rounding (2e-16 in fp64).
        average = (seg_id == torch.arange(num_segments, device=x.device)[:, None]).to(x.dtype) / counts[:, None]
        return average @ x
    sums = x.new_zeros(*x.shape[:-2], num_segments, x.shape[-1]).index_add_(-2, seg_id, x)
    return sums / counts[:, None]


def depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The skip connection's ``Conv2d(h, h, (k, 1), groups=h)`` (weight (h, 1, k, 1)) on (b, h, n, d), as a grouped
    conv1d. Not the Conv2d itself: on x86 CPUs oneDNN's depthwise kernel (jit_dw, oneDNN 3.12 in torch 2.13)
    gets its fp32 weight gradient wrong at some of the paper's sizes (3-14% off fp64: k = 65 at n = 128 to 1024,
    k = 33 at n = 256), while its conv1d kernel is right (< 1e-6); on GPUs and in fp64 the two agree."""
    b, h, n, d = x.shape
    k = weight.shape[-2]
    xs = x.permute(0, 3, 1, 2).reshape(b * d, h, n)
    y = F.conv1d(xs, weight.reshape(h, 1, k).to(x.dtype), padding=k // 2, groups=h)
    return y.reshape(b, d, h, n).permute(0, 2, 3, 1)


def pinv_init(a: torch.Tensor, init: str = "original", init_rows: Optional[int] = None) -> torch.Tensor:
    """Z₀ of ``iterative_pinv`` (see there); shared with the fast path so both start from the same point."""
    if init == "original":
        col_sums = torch.sum(a, dim=-2)
        rows = a.shape[0]
        if init_rows is not None and init_rows < 1:
            raise ValueError(f"init_rows: must be >= 1 (or None for the whole batch), got {init_rows}")
        if init_rows is None or init_rows >= rows:
            return a.transpose(-1, -2) / torch.max(col_sums)
        # The max over each group of init_rows batch rows, as if each group were its own batch (the last may be
        # shorter: padded with -inf rows). One amax per group, whose backward splits the gradient evenly over
        # the group's tied entries as torch.max's does over the batch's.
        groups = -(-rows // init_rows)
        flat = F.pad(col_sums.reshape(rows, -1), (0, 0, 0, groups * init_rows - rows), value=float("-inf"))
        group_max = flat.reshape(groups, -1).amax(dim=1).repeat_interleave(init_rows)[:rows]
        return a.transpose(-1, -2) / group_max.reshape((rows,) + (1,) * (a.dim() - 1))
    if init == "exact":
        norm_1 = a.abs().sum(dim=-2).amax(dim=-1)    # max column sum, per matrix
        norm_inf = a.abs().sum(dim=-1).amax(dim=-1)  # max row sum, per matrix
        return a.transpose(-1, -2) / (norm_1 * norm_inf)[..., None, None]
    raise ValueError(f"unknown pseudo-inverse init {init!r} (expected 'original' or 'exact')")


def iterative_pinv(a: torch.Tensor, num_iterations: int = 6, init: str = "original",
                   init_rows: Optional[int] = None) -> torch.Tensor:
    """Moore–Penrose pseudo-inverse of each matrix in ``a`` (..., m, m) by the paper's iteration

        Z ← ¼ Z (13I − AZ(15I − AZ(7I − AZ)))

    from Z₀ = Aᵀ / (‖A‖₁ ‖A‖∞). ``init="original"`` reproduces the authors' code: ‖A‖∞ taken as 1
    (rows of a softmax sum to 1) and ‖A‖₁ as the largest column sum over the *whole batch*, so one
    matrix's scale depends on its batch mates; ``init_rows`` (``NystromAttention.init_rows``) limits the batch
    mates to each group of that many consecutive rows of dim 0, so that one pass over several groups computes
    what a pass per group would. ``init="exact"`` uses both norms of each matrix itself.
    """
    eye = torch.eye(a.shape[-1], device=a.device, dtype=a.dtype)
    z = pinv_init(a, init, init_rows)
    for _ in range(num_iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


IMPLS = ("auto", "reference", "fast")


class AttentionSettingError(UserError, ValueError):
    """An invalid NYSTROM_* environment variable (or module setting)."""


def use_fast_path(q: torch.Tensor, impl: str = "auto") -> bool:
    """Which formulation ``NystromAttention.forward`` runs.

    ``impl`` (the module's ``impl`` attribute, default "auto") is overridden by the environment variable
    ``NYSTROM_IMPL`` when set: "auto" = the fast path (``nystrom_fast``) on CUDA, the reference elsewhere;
    "reference" = always the reference (e.g. to compare or to rule the fast path out); "fast" = always the fast
    path (on CPU it runs as plain PyTorch ops: that is how it is tested without a GPU).
    """
    impl = os.environ.get("NYSTROM_IMPL") or impl
    if impl not in IMPLS:
        raise AttentionSettingError(f"NYSTROM_IMPL / impl: expected one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return q.is_cuda
    return impl == "fast"


@register("nystrom")
class NystromAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_landmarks = config.num_landmarks
        self.pinv_iterations = config.pinv_iterations
        self.init_option = config.inv_coeff_init_option
        self.impl = "auto"  # see use_fast_path; NYSTROM_IMPL overrides it
        # init="original": the batch max over groups of this many rows (None: the whole batch). A run setting,
        # not a weight: pretraining sets it to inst_per_gpu so that a pass of several micro-batches' rows
        # computes what one pass per micro-batch would (model.set_batch_groups).
        self.init_rows: Optional[int] = None
        self.conv = None
        if config.conv_kernel_size is not None:
            k = config.conv_kernel_size
            # Depthwise over heads, along the sequence, shared across the head dim: the paper's layout,
            # kept so that checkpoints map one-to-one onto the authors' and transformers' weights.
            self.conv = nn.Conv2d(config.num_head, config.num_head, kernel_size=(k, 1), padding=(k // 2, 0),
                                  bias=False, groups=config.num_head)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        if use_fast_path(q, self.impl):
            from . import nystrom_fast
            return nystrom_fast.forward(q, k, v, mask, num_landmarks=self.num_landmarks,
                                        pinv_iterations=self.pinv_iterations, init=self.init_option,
                                        init_rows=self.init_rows,
                                        conv_weight=None if self.conv is None else self.conv.weight)
        return self.reference_forward(q, k, v, mask)

    def reference_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The authors' formulation: the oracle for the fast path, and the CPU path."""
        n = q.shape[-2]
        mask = key_padding_mask(mask, q)
        keep = mask[:, None, :, None].to(q.dtype)
        scale = self.head_dim ** -0.25
        q = q * keep * scale
        k = k * keep * scale
        # Padded keys get the most negative finite score: an all-padding row stays finite.
        key_bias = (1.0 - mask[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min

        if self.num_landmarks >= n:
            out = torch.softmax(q @ k.transpose(-1, -2) + key_bias, dim=-1) @ v
        else:
            q_land = segment_means(q, self.num_landmarks)
            k_land = segment_means(k, self.num_landmarks)
            kernel_1 = torch.softmax(q @ k_land.transpose(-1, -2), dim=-1)
            kernel_2 = torch.softmax(q_land @ k_land.transpose(-1, -2), dim=-1)
            kernel_3 = torch.softmax(q_land @ k.transpose(-1, -2) + key_bias, dim=-1)
            pinv = iterative_pinv(kernel_2, self.pinv_iterations, self.init_option, self.init_rows)
            out = (kernel_1 @ pinv) @ (kernel_3 @ v)

        if self.conv is not None:
            out = out + depthwise_conv(v * keep, self.conv.weight)
        return out
