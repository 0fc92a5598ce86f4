"""Longformer attention (Beltagy et al., 2020): sliding window + global tokens, in banded (blocked) form.

Token i attends to key j when |i − j| ≤ w//2 (w = ``window_size``), and to the first
g = ``num_global_tokens`` tokens; those g global tokens attend to every key. Scores carry 1/√d and
padded keys are excluded exactly. With w//2 ≥ n − 1 every query sees every key: exact softmax attention.

Memory is O(n·w), not O(n²): the sequence is cut into chunks of c = max(1, w//2) queries, each chunk
scores only the 3c keys of its own and neighbouring chunks (the band is then masked inside that
3c-wide strip), plus the g global key columns; the g global query rows are computed densely (O(g·n)).
Dilation and per-layer window sizes of the paper are not implemented.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import key_padding_mask, register


def _pad_seq(x: torch.Tensor, total: int) -> torch.Tensor:
    return x if x.shape[-2] == total else F.pad(x, (0, 0, 0, total - x.shape[-2]))


@register("longformer")
class LongformerAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.window_size = config.window_size
        self.num_global_tokens = config.num_global_tokens

    def forward(self, q, k, v, mask):
        mask = key_padding_mask(mask, q)  # no padding-free shortcut here
        b, h, n, d = q.shape
        scale = self.head_dim ** -0.5
        neg = torch.finfo(q.dtype).min
        half = self.window_size // 2
        c = max(1, min(half, n))
        g = min(self.num_global_tokens, n)
        total = -(-n // c) * c
        nc = total // c
        qp, kp, vp = (_pad_seq(t, total) for t in (q, k, v))
        maskp = F.pad(mask.to(torch.bool), (0, total - n))

        # Window strip: chunk i sees keys at positions i·c − c … i·c + 2c − 1.
        k_win = F.pad(kp, (0, 0, c, c)).unfold(2, 3 * c, c).transpose(-1, -2)   # (b, h, nc, 3c, d)
        v_win = F.pad(vp, (0, 0, c, c)).unfold(2, 3 * c, c).transpose(-1, -2)
        key_ok = F.pad(maskp, (c, c)).unfold(1, 3 * c, c)                      # (b, nc, 3c)
        qpos = torch.arange(total, device=q.device).view(nc, c)
        kpos = torch.arange(-c, total + c, device=q.device).unfold(0, 3 * c, c)  # (nc, 3c)
        band = ((qpos[:, :, None] - kpos[:, None, :]).abs() <= half) & (kpos[:, None, :] >= g)
        allowed = band[None] & key_ok[:, :, None, :]                            # (b, nc, c, 3c)

        q_chunks = qp.view(b, h, nc, c, d)
        s_win = (q_chunks @ k_win.transpose(-1, -2)) * scale
        s_win = s_win.masked_fill(~allowed[:, None], torch.finfo(s_win.dtype).min)  # autocast: bf16 scores
        parts = [s_win]
        if g > 0:
            s_glob = (q_chunks @ k[:, :, :g].transpose(-1, -2)[:, :, None]) * scale   # (b, h, nc, c, g)
            glob_ok = mask[:, :g].to(torch.bool)[:, None, None, None, :]
            parts.append(s_glob.masked_fill(~glob_ok, torch.finfo(s_glob.dtype).min))
        p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
        out = p[..., :3 * c] @ v_win
        if g > 0:
            out = out + p[..., 3 * c:] @ v[:, :, :g][:, :, None]
        out = out.reshape(b, h, total, d)[:, :, :n]

        if g > 0:  # global queries see everything
            bias = (~mask.to(torch.bool))[:, None, None, :].to(q.dtype) * neg
            glob = torch.softmax((q[:, :, :g] @ k.transpose(-1, -2)) * scale + bias, dim=-1) @ v
            out = torch.cat([glob, out[:, :, g:]], dim=2)
        return out
