"""Reformer LSH attention (Kitaev et al., ICLR 2020), shared-QK, chunked — O(n·c) memory.

Shared QK: Reformer uses one projection for queries and keys. Our interface passes separate ``q`` and
``k``; this variant uses ``q`` as the shared query/key and ignores ``k`` (``reads_keys = False``: the layer
does not compute k at all, and its key projection gets no gradient). Keys are the unit-normalised queries times
d^-1/2 (as in the reference code), so the score of query i on key j is q_i·q_j / (‖q_j‖ √d).

Per round (``reformer_num_hashes`` rounds): a random rotation R (d × nb/2, per head) hashes each position to
argmax([xR; −xR]) of nb buckets, nb = padded length / c rounded up to even (c = ``reformer_bucket_size``).
Positions are sorted by (round, bucket, position), cut into chunks of c, and each chunk attends to itself and
the previous chunk. A query never attends to itself unless nothing else is available (score −1e5, as in the
reference). Rounds are combined with weights softmax over rounds of each round's log-sum-exp. Rotations: in
training, fresh from torch's RNG every forward (as in the paper); in evaluation, fixed — drawn from a generator
seeded by ``EVAL_HASH_SEED`` and nb, the same in every layer (their queries differ) — so a dev score or test
prediction does not change from one call, batch size or process to the next (as Performer's features are not
redrawn in evaluation). Duplicate keys across rounds are not de-duplicated (as in the reference
implementations).

Padding: padded positions go to an extra last bucket, so they are sorted after every real token and
their contents never change which chunk a real token lands in; padded keys are masked out of every
chunk. So padded contents never change real outputs (for the same random rotation); the *amount* of
padding does (it sets nb). With a single chunk (n ≤ c) the result is exact softmax attention with the
shared-QK scores, excluding self.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import key_padding_mask, register

SELF_SCORE = -1e5
EVAL_HASH_SEED = 20200113  # any fixed number: evaluation's rotations must not depend on torch's RNG state


def lsh_buckets(rotated: torch.Tensor) -> torch.Tensor:
    """argmax([xR; −xR]) over the last dim, without building the concatenation (which would double the
    O(N · nb) rotated tensor): the larger of max(xR) and −min(xR) wins, ties going to the first half as
    argmax's first occurrence does."""
    top, top_idx = rotated.max(dim=-1)
    bottom, bottom_idx = rotated.min(dim=-1)
    return torch.where(top >= -bottom, top_idx, bottom_idx + rotated.shape[-1])


@register("reformer")
class ReformerAttention(nn.Module):
    reads_keys = False  # shared QK: the model passes q as k and computes no key projection

    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_hashes = config.reformer_num_hashes
        self.bucket_size = config.reformer_bucket_size
        self.num_heads = config.num_head
        self._eval_rotations = {}  # (shape, device) -> fp64 rotation: drawn once, not on every evaluation forward

    def rotation_shape(self, seq_len: int, heads: int) -> tuple:
        """(heads, dim, rounds, buckets/2) for a (padded) length: nb = chunks rounded up to even, at least 2."""
        chunks = -(-seq_len // self.bucket_size)
        return heads, self.head_dim, self.num_hashes, max(2, chunks + chunks % 2) // 2

    def prepare(self, seq_len: int, device) -> None:
        """Before each forward pass (eagerly): in evaluation, this length's fixed rotation on the device — drawn
        inside a compiled forward, it split the graph at every layer."""
        if not self.training:
            self._eval_rotation(self.rotation_shape(seq_len, self.num_heads), device)

    def _eval_rotation(self, shape, device) -> torch.Tensor:
        key = (tuple(shape), str(device))
        if key not in self._eval_rotations:
            if len(self._eval_rotations) >= 16:  # a few lengths in a run: never grows without bound
                self._eval_rotations.clear()
            generator = torch.Generator().manual_seed(EVAL_HASH_SEED * 1000003 + shape[-1])
            self._eval_rotations[key] = torch.randn(shape, generator=generator, dtype=torch.float64).to(device)
        return self._eval_rotations[key]

    def rotation(self, shape, device, dtype) -> torch.Tensor:
        """(heads, dim, rounds, buckets/2): fresh in training; in evaluation the same for every call of this
        shape (drawn on the CPU in fp64 from a fixed seed, so the same on any device and in any dtype)."""
        if self.training:
            return torch.randn(shape, device=device, dtype=dtype)
        return self._eval_rotation(shape, device).to(dtype)

    def forward(self, q, k, v, mask):
        mask = key_padding_mask(mask, q)  # no padding-free shortcut here
        b, h, n, d = q.shape
        c = self.bucket_size
        rounds = self.num_hashes
        total = -(-n // c) * c
        chunks_per_round = total // c
        shape = self.rotation_shape(n, h)
        nbk = 2 * shape[-1]
        qp = F.pad(q, (0, 0, 0, total - n))
        vp = F.pad(v, (0, 0, 0, total - n))
        maskp = F.pad(mask.to(torch.bool), (0, total - n))
        keys = F.normalize(qp, dim=-1) * d ** -0.5

        rot = self.rotation(shape, q.device, q.dtype)
        rotated = torch.einsum("bhnd,hdrk->bhrnk", qp.detach(), rot)                # (b, h, r, N, nb/2)
        buckets = lsh_buckets(rotated)                                               # (b, h, r, N)
        del rotated  # O(N · nb) = O(N²/c) memory, inherent in LSH with nb ∝ N: freed before attention
        buckets = buckets.masked_fill(~maskp[:, None, None, :], nbk)                 # padding last
        pos = torch.arange(total, device=q.device)
        offsets = torch.arange(rounds, device=q.device)[:, None] * (nbk + 1)
        ticker = ((buckets + offsets) * total + pos).flatten(2)                      # (b, h, r·N)
        order = ticker.argsort(dim=-1)                                               # flat index r·N + p
        src = order % total

        def gather(t):
            return t.gather(2, src[..., None].expand(-1, -1, -1, t.shape[-1]))

        num_chunks = rounds * chunks_per_round
        sq = gather(qp).view(b, h, num_chunks, c, d)
        sk = gather(keys).view(b, h, num_chunks, c, d)
        sv = gather(vp).view(b, h, num_chunks, c, v.shape[-1])
        spos = src.view(b, h, num_chunks, c)
        smask = maskp[:, None, :].expand(b, h, total).gather(2, src).view(b, h, num_chunks, c)
        if num_chunks > 1:  # look one chunk back
            back = lambda t: torch.cat([t, t.roll(1, dims=2)], dim=3)  # noqa: E731
            sk, sv, kpos, kmask = back(sk), back(sv), back(spos), back(smask)
        else:
            kpos, kmask = spos, smask

        scores = sq @ sk.transpose(-1, -2)                                           # (b, h, C, c, c or 2c)
        scores = scores.masked_fill(spos[..., :, None] == kpos[..., None, :], SELF_SCORE)
        scores = scores.masked_fill(~kmask[..., None, :], torch.finfo(scores.dtype).min)  # autocast: bf16
        lse = scores.logsumexp(dim=-1, keepdim=True)
        out = torch.exp(scores - lse) @ sv                                           # (b, h, C, c, d)

        undo = order.argsort(dim=-1)
        out = out.reshape(b, h, rounds * total, -1).gather(2, undo[..., None].expand(-1, -1, -1, out.shape[-1]))
        lse = lse.reshape(b, h, rounds * total).gather(2, undo)
        out = out.view(b, h, rounds, total, -1)
        weights = torch.softmax(lse.view(b, h, rounds, total), dim=2)
        return (out * weights[..., None]).sum(dim=2)[:, :, :n]
