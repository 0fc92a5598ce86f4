"""Linformer attention (Wang et al., 2020): keys and values projected along the sequence to length k.

    out = softmax(Q (E K)ᵀ / √d) (F V),       E, F: k × max_seq_len learned, sliced to E[:, :n] for n < max_seq_len

Sharing (``linformer_sharing``): ``"none"`` — an E and an F per head; ``"headwise"`` — one E and one F
shared by all heads; ``"kv"`` — one E = F for keys and values of all heads. Linformer's ``"layerwise"``
sharing (one projection for all layers) is not offered: each layer builds its own attention module.
Initialisation N(0, 0.02²), as the Nyströmformer authors' LRA code.

Padding: padded keys and values are zeroed before the projection, so they add nothing to the projected keys
and values: a padded row's real tokens get exactly the unpadded row's output (E, F sliced to its length). The
softmax is over the k projected keys, not over tokens (a row of E that sees no real token gives a zero key of
weight exp(0)). Time O(n k d), memory O(n k).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import key_padding_mask, register


class SequenceProjections(nn.Module):
    """The E (keys) and F (values) projections of Linformer, shaped (heads or 1, k, max_seq_len)."""

    def __init__(self, config):
        super().__init__()
        self.sharing = config.linformer_sharing
        heads = config.num_head if self.sharing == "none" else 1
        shape = (heads, config.linformer_k, config.max_seq_len)
        self.E = nn.Parameter(torch.empty(shape).normal_(0.0, 0.02))
        self.F = None if self.sharing == "kv" else nn.Parameter(torch.empty(shape).normal_(0.0, 0.02))

    def forward(self, k: torch.Tensor, v: torch.Tensor):
        n = k.shape[-2]
        if n > self.E.shape[-1]:
            raise ValueError(f"sequence length {n} exceeds the projections' max_seq_len {self.E.shape[-1]}")
        e = self.E[..., :n].to(k.dtype)
        f = e if self.F is None else self.F[..., :n].to(v.dtype)
        return e @ k, f @ v       # (b, h, k, d): heads broadcast when shared


@register("linformer")
class LinformerAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.proj = SequenceProjections(config)

    def forward(self, q, k, v, mask):
        mask = key_padding_mask(mask, q)  # no padding-free shortcut here
        keep = mask[:, None, :, None].to(q.dtype)
        k_proj, v_proj = self.proj(k * keep, v * keep)
        scores = q @ k_proj.transpose(-1, -2) * self.head_dim ** -0.5
        return torch.softmax(scores, dim=-1) @ v_proj
