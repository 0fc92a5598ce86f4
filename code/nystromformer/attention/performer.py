"""Performer attention: FAVOR+ with positive orthogonal random features (Choromanski et al., ICLR 2021).

With x scaled by d^-1/4 (so q·k carries the usual 1/√d), the positive random features

    φ(x) = exp(Wx − ‖x‖²/2) / √m,       W: m × d, rows ω_i ~ N(0, I_d), orthogonal within blocks of d

give E[φ(q)ᵀφ(k)] = exp(q·k), so softmax attention is estimated by linear attention with φ
(``linear.linear_attention``). Orthogonal blocks come from the QR factorisation of Gaussian matrices,
with the signs of R's diagonal folded in (so Q is Haar-distributed; the authors' code leaves them out, which biases
the estimate), each row rescaled to the norm of an independent Gaussian vector (so marginals stay N(0, I)).
As in the authors' code, a stabiliser is subtracted inside the exponent: the per-row max for queries and
the max over (real) keys for keys; both cancel in the normalisation. A small constant (1e-6) is added to
each feature as in the authors' code, so the normaliser is never zero — except for a row whose keys are all
padding, whose output is 0.

Feature redraw: the projection is a buffer (saved in checkpoints) redrawn every
``performer_redraw_interval`` training forward passes (0: never); evaluation never redraws. The count is kept by
``prepare()``, which the encoder calls once per pass, eagerly, outside any recompute — with
``attention_grad_checkpointing`` the backward runs ``forward`` again, which must see the features the forward saw —
and in a Python int beside the buffer (re-read only after an outside write: a load, a DDP broadcast), so that
counting reads nothing back from the device.
New features are drawn from a generator seeded by a hash of the current ones, a function of the saved state
alone: every DDP rank draws the same features (the global RNG is seeded per rank), and a resumed run draws what
an uninterrupted one would. Padded keys are exact: their features are zeroed.

The key stabiliser is detached, as in the FAVOR+ reference code: with the 1e-6 added after it, the features do
depend on it slightly, so the gradient is that of the forward to about 1e-6 relative (not exact; gradcheck fails).
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn

from . import BufferWrites, key_padding_mask, register
from .linear import linear_attention

FEATURE_EPS = 1e-6


def orthogonal_gaussian(num_features: int, dim: int, generator=None, dtype=torch.float32) -> torch.Tensor:
    blocks = []
    for _ in range(math.ceil(num_features / dim)):
        g = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        qmat, r = torch.linalg.qr(g)
        # QR fixes the signs of R's diagonal, which biases Q (its first column always points one way): flipping
        # columns to R's signs makes Q Haar-distributed, so each row is a uniformly random direction.
        blocks.append((qmat * torch.sign(torch.diagonal(r))).T)
    w = torch.cat(blocks, dim=0)[:num_features]
    norms = torch.randn(num_features, dim, generator=generator, dtype=torch.float64).norm(dim=-1)
    return (w * norms[:, None]).to(dtype)


def positive_features(x: torch.Tensor, w: torch.Tensor, is_query: bool, key_keep=None) -> torch.Tensor:
    """φ(x) for x already scaled by d^-1/4; ``key_keep`` (..., n, 1) restricts the key stabiliser to real keys."""
    proj = x @ w.transpose(-1, -2) - 0.5 * (x * x).sum(dim=-1, keepdim=True)  # (..., n, m): ωᵀx − ‖x‖²/2
    if is_query:
        stab = proj.amax(dim=-1, keepdim=True)
    else:
        masked = proj if key_keep is None else proj.masked_fill(key_keep == 0, float("-inf"))
        stab = masked.amax(dim=(-1, -2), keepdim=True)
        stab = torch.where(torch.isfinite(stab), stab, torch.zeros_like(stab))  # all padding: no key, no -inf
    stab = stab.detach()
    return (torch.exp(proj - stab) + FEATURE_EPS) / math.sqrt(w.shape[0])


@register("performer")
class PerformerAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_features = config.performer_num_features
        self.redraw_interval = config.performer_redraw_interval
        self.register_buffer("projection", orthogonal_gaussian(self.num_features, self.head_dim))
        self.register_buffer("forwards_since_redraw", torch.zeros((), dtype=torch.long))
        # the buffer's value kept on the host, read back only when something else wrote the buffer (a state dict
        # loaded, a DDP broadcast): counting reads nothing from the device
        self._since_redraw, self._count_writes = 0, BufferWrites(self.forwards_since_redraw)

    @torch.no_grad()
    def redraw(self) -> None:
        seed = zlib.crc32(self.projection.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        w = orthogonal_gaussian(self.num_features, self.head_dim, generator=torch.Generator().manual_seed(seed))
        self.projection.copy_(w.to(self.projection.device, self.projection.dtype))
        self._since_redraw = 0
        self.forwards_since_redraw.zero_()
        self._count_writes.read(self.forwards_since_redraw)

    @torch.no_grad()
    def prepare(self, seq_len: int, device) -> None:
        """Before each forward pass: in training, count it, redrawing the features when their interval is up."""
        if self.training and self.redraw_interval > 0:
            count = self.forwards_since_redraw
            if self._count_writes.written(count):
                self._since_redraw = int(count)
            if self._since_redraw >= self.redraw_interval:
                self.redraw()
            self._since_redraw += 1
            count.fill_(self._since_redraw)
            self._count_writes.read(count)

    def forward(self, q, k, v, mask):
        mask = key_padding_mask(mask, q)  # no padding-free shortcut here
        scale = self.head_dim ** -0.25
        w = self.projection.to(q.dtype)
        keep = mask[:, None, :, None].to(q.dtype)
        phi_q = positive_features(q * scale, w, is_query=True)
        phi_k = positive_features(k * keep * scale, w, is_query=False, key_keep=keep) * keep
        return linear_attention(phi_q, phi_k, v, eps=0.0)
