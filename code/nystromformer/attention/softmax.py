"""Exact softmax attention through PyTorch's fused scaled_dot_product_attention."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import register


@register("softmax")
class SoftmaxAttention(nn.Module):
    def __init__(self, config):
        super().__init__()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        # Key-padding mask: True where a key may be attended to. None (no padding) lets SDPA use FlashAttention.
        attn_mask = None if mask is None else mask[:, None, None, :].to(torch.bool)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
