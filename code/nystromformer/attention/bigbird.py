"""BigBird attention (Zaheer et al., NeurIPS 2020), ITC form, computed block-sparse.

The sequence is cut into blocks of ``block_size`` (the last one padded). Query block i attends to key
blocks: i−1, i, i+1 (window), the first ``bigbird_num_global_blocks`` blocks (global), and
``bigbird_num_random_blocks`` random other blocks; the global blocks attend to every block. Scores carry
1/√d and padded keys are excluded exactly, so the result equals a dense softmax masked with the
token-level pattern ``block_pattern(nb)[i // bs, j // bs] & mask[j]`` (tests check this).

Random blocks: drawn once per layer and block count from a seed stored as a buffer (so a checkpoint
reloads the same pattern) — fixed, not resampled each step. Memory O(n·(3 + g + r)·bs): for each
non-global query block the selected key/value blocks are gathered; global query rows are dense, O(g·bs·n).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BufferWrites, key_padding_mask, register


@register("bigbird")
class BigBirdAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.block_size = config.block_size
        self.num_random = config.bigbird_num_random_blocks
        self.num_global = config.bigbird_num_global_blocks
        # drawn on the host (also when the model is built on the meta device, for a shape check) and kept there:
        # reading the buffer back is a device sync, and inside a compiled forward a graph break
        self._seed = int(torch.randint(0, 2 ** 31 - 1, (), device="cpu"))
        self.register_buffer("pattern_seed", torch.tensor(self._seed))
        self._seed_writes = BufferWrites(self.pattern_seed)
        self._cache: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._on_device: Dict[Tuple[int, int, str], Tuple[torch.Tensor, torch.Tensor]] = {}

    def _host_seed(self) -> int:
        """The buffer's value, read back only when something wrote it (a state dict loaded, a DDP broadcast)."""
        buffer = self.pattern_seed
        if self._seed_writes.written(buffer) and not buffer.is_meta:
            self._seed = int(buffer)
            self._seed_writes.read(buffer)
        return self._seed

    def prepare(self, seq_len: int, device) -> None:
        """Before each forward pass (eagerly): the layout of this length's blocks, on the device."""
        self._gather_index(-(-seq_len // self.block_size), self._host_seed(), device)

    def _gather_index(self, nb: int, seed: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (nb, seed, str(device))
        if key not in self._on_device:
            if len(self._on_device) >= 16:  # a few lengths in a run: never grows without bound
                self._on_device.clear()
            _, idx, valid = self._layout(nb, seed)
            self._on_device[key] = (idx.to(device), valid.to(device))
        return self._on_device[key]

    def block_pattern(self, nb: int) -> torch.Tensor:
        """(nb, nb) bool: which key blocks each query block attends to."""
        return self._layout(nb, self._host_seed())[0]

    def _layout(self, nb: int, seed: int):
        key = (nb, seed)
        if key not in self._cache:
            g = min(self.num_global, nb)
            gen = torch.Generator().manual_seed(seed * 1000003 + nb)
            pat = torch.zeros(nb, nb, dtype=torch.bool)
            pat[:g] = True
            pat[:, :g] = True
            i = torch.arange(nb)
            pat |= (i[:, None] - i[None, :]).abs() <= 1
            for row in range(g, nb):
                free = (~pat[row]).nonzero().flatten()
                if len(free):
                    pick = free[torch.randperm(len(free), generator=gen)[:self.num_random]]
                    pat[row, pick] = True
            rows = [pat[r].nonzero().flatten() for r in range(nb)]
            width = max([len(rows[r]) for r in range(g, nb)] or [1])
            idx = torch.zeros(nb, width, dtype=torch.long)
            valid = torch.zeros(nb, width, dtype=torch.bool)
            for r in range(g, nb):
                idx[r, :len(rows[r])] = rows[r]
                valid[r, :len(rows[r])] = True
            self._cache[key] = (pat, idx, valid)
        return self._cache[key]

    def forward(self, q, k, v, mask):
        mask = key_padding_mask(mask, q)  # no padding-free shortcut here
        b, h, n, d = q.shape
        bs = self.block_size
        scale = self.head_dim ** -0.5
        neg = torch.finfo(q.dtype).min
        total = -(-n // bs) * bs
        nb = total // bs
        g = min(self.num_global, nb)
        pad = (0, 0, 0, total - n)
        qp, kp, vp = (F.pad(t, pad) for t in (q, k, v))
        maskp = F.pad(mask.to(torch.bool), (0, total - n))
        # compiled, the encoder's prelude has read the seed (prepare); eager, a direct call reads it here
        seed = self._seed if torch.compiler.is_compiling() else self._host_seed()
        idx, valid = self._gather_index(nb, seed, q.device)
        width = idx.shape[1]

        k_sel = kp.view(b, h, nb, bs, d)[:, :, idx].reshape(b, h, nb, width * bs, d)
        v_sel = vp.view(b, h, nb, bs, d)[:, :, idx].reshape(b, h, nb, width * bs, d)
        ok = (maskp.view(b, nb, bs)[:, idx] & valid[None, :, :, None]).reshape(b, nb, width * bs)
        scores = (qp.view(b, h, nb, bs, d) @ k_sel.transpose(-1, -2)) * scale     # (b, h, nb, bs, width·bs)
        scores = scores.masked_fill(~ok[:, None, :, None, :], torch.finfo(scores.dtype).min)  # autocast: bf16
        out = (torch.softmax(scores, dim=-1) @ v_sel).reshape(b, h, total, d)

        if g > 0:  # global query blocks see every key
            rows = g * bs
            bias = (~maskp)[:, None, None, :].to(q.dtype) * neg
            glob = torch.softmax((qp[:, :, :rows] @ kp.transpose(-1, -2)) * scale + bias, dim=-1) @ vp
            out = torch.cat([glob, out[:, :, rows:]], dim=2)
        return out[:, :, :n]
