"""Linear attention with the elu(x)+1 feature map (Katharopoulos et al., ICML 2020).

    out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ  /  φ(q_i)ᵀ Σ_j φ(k_j),     φ(x) = elu(x) + 1

computed right-to-left in O(n d²) time and O(d²) extra memory per head. There is no 1/√d temperature:
the kernel is not a softmax, and the method as published applies none. Padded keys are exact: φ(k_j)
is zeroed there, so they are excluded from both sums.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import key_padding_mask, register

EPS = 1e-6


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """φ(Q)(φ(K)ᵀV) / φ(Q)(φ(K)ᵀ1) with non-negative feature maps already applied (padded φ(k) zeroed). A row
    whose keys are all padding has a zero normaliser: its output is 0 (not 0/0), with finite gradients."""
    kv = phi_k.transpose(-1, -2) @ v                      # (..., m, d_v)
    normaliser = phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)  # (..., n, 1)
    normaliser = torch.where(normaliser > 0, normaliser, torch.ones_like(normaliser))
    return (phi_q @ kv) / (normaliser + eps)


@register("linear")
class LinearAttention(nn.Module):
    def __init__(self, config):
        super().__init__()

    def forward(self, q, k, v, mask):
        mask = key_padding_mask(mask, q)  # no padding-free shortcut here
        keep = mask[:, None, :, None].to(q.dtype)
        return linear_attention(F.elu(q) + 1, (F.elu(k) + 1) * keep, v)
