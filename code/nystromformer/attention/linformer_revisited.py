"""The "Revisiting Linformer" variant: Linformer's projections with softmax on the factors, O(n·d·k + n·d²).

As implemented (with Q, K scaled by d^-1/4 so the factors carry the usual 1/√d between them):

    K̂ = E K,  V̂ = F V                                (k × d; E, F as Linformer, padded K, V zeroed first)
    A = softmax_d(Q)        — softmax of each query over its d features           (n × d)
    B = softmax_k(K̂)        — softmax of each feature over the k projected keys   (k × d)
    out = A (Bᵀ V̂)                                     (n × d; Bᵀ V̂ is d × d)

Each row of A and each column of B sums to 1, so every output row is a convex combination of the rows
of V̂ — a normalised attention over the k projected values, computed without any n × n or n × k matrix
(the "efficient attention" factorisation applied to Linformer's projected keys/values). E, F and
``linformer_sharing`` / ``linformer_k`` are shared with ``linformer``. Padding behaves as Linformer's:
exact (a padded row's real tokens get the unpadded row's output).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import key_padding_mask, register
from .linformer import SequenceProjections


@register("linformer_revisited")
class RevisitedLinformerAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.proj = SequenceProjections(config)

    def forward(self, q, k, v, mask):
        mask = key_padding_mask(mask, q)  # no padding-free shortcut here
        keep = mask[:, None, :, None].to(q.dtype)
        scale = self.head_dim ** -0.25
        k_proj, v_proj = self.proj(k * keep, v * keep)
        a = torch.softmax(q * scale, dim=-1)            # (b, h, n, d)
        b = torch.softmax(k_proj * scale, dim=-2)       # (b, h, k, d), over the k projected keys
        return a @ (b.transpose(-1, -2) @ v_proj)       # (b, h, n, d_v)
