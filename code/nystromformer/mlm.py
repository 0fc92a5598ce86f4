"""Masked-language-model data: deterministic sample order, 80/10/10 masking, and dev evaluation.

Everything random here is a pure function of (seed, step): a resumed run draws exactly the batches and
masks the uninterrupted run would have, and every DDP rank draws the same global batch and takes its slice.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from .model import IGNORE_INDEX, fixed_weights, masked_positions_of
from .shards import ShardedSequences

# What a dev evaluation measures, recorded with each figure (pretraining's dev entries, validation's): figures of
# another version are not comparable. 2 (2026-11-23): a seeded sample of the whole dev split (was: its first rows),
# random replacements never special tokens.
DEV_EVAL_VERSION = 2
# Streams of the per-step seeds, so that training masks, dev masks and dropout never share draws.
STREAM_ORDER, STREAM_MASK, STREAM_DEV_MASK, STREAM_DROPOUT, STREAM_DEV_SAMPLE = range(5)


def derived_seed(seed: int, stream: int, index: int, rank: int = 0) -> int:
    return int(np.random.SeedSequence([seed, stream, index, rank]).generate_state(1)[0])


def generator(seed: int, stream: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(seed, stream, index))


class SampleOrder:
    """Sequence indices of an endless stream of shuffled passes over the training split.

    Sample i of the stream is row perm_p[i mod N] with p = i // N and perm_p a seeded permutation, so a
    run's data position is just the number of sequences consumed so far (``inst_pass``)."""

    def __init__(self, num_sequences: int, seed: int):
        if num_sequences == 0:
            raise ValueError("the training split has no sequences")
        self.n, self.seed = num_sequences, seed
        self._pass, self._perm = -1, None

    def _permutation(self, p: int) -> np.ndarray:
        if p != self._pass:
            self._pass = p
            self._perm = np.random.default_rng(derived_seed(self.seed, STREAM_ORDER, p)).permutation(self.n)
        return self._perm

    def indices(self, start: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        for j, i in enumerate(range(start, start + count)):
            out[j] = self._permutation(i // self.n)[i % self.n]
        return out


def mask_tokens(ids: torch.Tensor, gen: torch.Generator, mask_prob: float, special: Dict[str, int],
                vocab_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: choose ``mask_prob`` of the non-special tokens; of those 80% → <mask>, 10% → a random
    ordinary token (never a special one: a random <pad> would be masked out of attention, a random </s> read as a
    document boundary), 10% unchanged. Returns (inputs, labels) with labels = IGNORE_INDEX where not chosen."""
    never = torch.zeros_like(ids, dtype=torch.bool)
    for special_id in set(special.values()):  # <unk> and <mask> too, should the data hold them
        never |= ids == special_id
    chosen = (torch.rand(ids.shape, generator=gen) < mask_prob) & ~never
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    action = torch.rand(ids.shape, generator=gen)
    random_ids = ordinary_token_ids(torch.randint(0, vocab_size - len(set(special.values())), ids.shape,
                                                  generator=gen), special)
    inputs = ids.clone()
    inputs[chosen & (action < 0.8)] = special["mask"]
    swap = chosen & (action >= 0.8) & (action < 0.9)
    inputs[swap] = random_ids[swap]
    return inputs, labels


def ordinary_token_ids(rank: torch.Tensor, special: Dict[str, int]) -> torch.Tensor:
    """The ``rank``-th (0-based) id that is not a special token's: each special id at or below it moves it up one."""
    for special_id in sorted(set(special.values())):
        rank = rank + (rank >= special_id).to(rank.dtype)
    return rank


def micro_batches(total: int, size: int):
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))


def padding_mask(inputs: torch.Tensor, pad_id: int) -> Optional[torch.Tensor]:
    """The attention mask (1 = token, 0 = padding) for a CPU batch, or None when no row has padding — as for
    full-length pretraining rows — so the attention skips the masking work. Decided on the CPU: no device sync."""
    is_token = inputs != pad_id
    return None if bool(is_token.all()) else is_token.long()


def to_device(tensors, device: torch.device):
    """Copy CPU tensors (None passes through) to ``device`` without making the host wait: on CUDA through pinned
    memory, as a copy from pageable memory synchronises with the device."""
    if device.type != "cuda":
        return tuple(None if t is None else t.to(device) for t in tensors)
    return tuple(None if t is None else t.pin_memory().to(device, non_blocking=True) for t in tensors)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ShardedSequences, num_sequences: int, micro_batch: int,
             seed: int, mask_prob: float, device: torch.device, autocast_dtype: Optional[torch.dtype] = None,
             rank: int = 0, world_size: int = 1) -> Dict[str, float]:
    """MLM loss and accuracy on ``num_sequences`` dev sequences (``dev_sample``: spread over the whole split) with
    fixed masks (the same rows and masks for every checkpoint, so validation curves compare like with like), and
    ``commonest_token_accu``: the
    accuracy of always predicting the commonest token of those masked positions, the bar a model must clear to
    have learnt more than one token (a stalled or collapsed model sits on it)."""
    special = data.meta["special_tokens"]
    vocab_size = data.meta["vocab_size"]
    num_sequences = min(num_sequences, len(data))
    sample = dev_sample(len(data), num_sequences, seed)
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, masked, correct
    label_counts = torch.zeros(vocab_size, dtype=torch.int64)  # of the masked positions, counted on the host
    starts = range(rank * micro_batch, num_sequences, micro_batch * world_size)
    # One autocast region and fixed weights for the whole evaluation: the weights' casts are made once.
    with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None), \
            fixed_weights(model):
        for start in starts:
            rows = sample[start:start + micro_batch]
            ids = torch.from_numpy(data.rows(rows))
            # One mask stream per dev row: the masks do not depend on the micro-batch size or the rank count.
            masked = [mask_tokens(ids[i:i + 1], generator(seed, STREAM_DEV_MASK, int(r)), mask_prob, special,
                                  vocab_size) for i, r in enumerate(rows)]
            inputs, labels = torch.cat([m[0] for m in masked]), torch.cat([m[1] for m in masked])
            label_counts += torch.bincount(labels[labels != IGNORE_INDEX], minlength=vocab_size)
            attention_mask = padding_mask(inputs, special["pad"])
            inputs, labels, attention_mask, positions = to_device((inputs, labels, attention_mask,
                                                                   masked_positions_of(labels)), device)
            out = model(inputs, labels, attention_mask=attention_mask, masked_positions=positions)
            totals += torch.stack([out.loss_sum.double(), out.num_masked.double(), out.num_correct.double()])
    if world_size > 1:
        torch.distributed.all_reduce(totals)
        label_counts = label_counts.to(device)
        torch.distributed.all_reduce(label_counts)
    model.train(was_training)
    loss_sum, masked, correct = totals.tolist()
    return {"loss": loss_sum / max(masked, 1), "mlm_accu": correct / max(masked, 1),
            "commonest_token_accu": int(label_counts.max()) / max(masked, 1),
            "num_sequences": num_sequences, "num_masked": int(masked), "eval_version": DEV_EVAL_VERSION}


def dev_sample(num_rows: int, num_sequences: int, seed: int) -> np.ndarray:
    """The dev rows an evaluation uses: all of them, or a seeded random ``num_sequences`` of them (in row order,
    the same for every checkpoint). Not the first rows: the dev split holds its datasets one after another
    (wiki first in the Makefile's mixture), so a prefix would measure one corpus only."""
    if num_sequences >= num_rows:
        return np.arange(num_rows)
    rng = np.random.default_rng(derived_seed(seed, STREAM_DEV_SAMPLE, 0))
    return np.sort(rng.choice(num_rows, size=num_sequences, replace=False))


def accuracy_note(metrics: Dict[str, float]) -> str:
    """The console's words for a dev accuracy beside the commonest-token bar."""
    bar = metrics["commonest_token_accu"]
    note = f" (commonest token: {bar:.4f}"
    if metrics["mlm_accu"] <= bar:
        note += "; no better than always predicting it: the model has not learnt, or has collapsed, to one token"
    return note + ")"


def evaluate_fp16_safe(model: torch.nn.Module, data: ShardedSequences, num_sequences: int, micro_batch: int,
                       seed: int, mask_prob: float, device: torch.device,
                       autocast_dtype: Optional[torch.dtype] = None, rank: int = 0,
                       world_size: int = 1) -> Tuple[Dict[str, float], bool]:
    """``evaluate``, measured again in fp32 when fp16's range overflowed (a non-finite loss): that can happen on a
    dev batch while the weights are fine (training skips such steps). Returns (metrics, whether it was redone)."""
    metrics = evaluate(model, data, num_sequences, micro_batch, seed, mask_prob, device, autocast_dtype, rank,
                       world_size)
    if autocast_dtype != torch.float16 or math.isfinite(metrics["loss"]):
        return metrics, False
    return evaluate(model, data, num_sequences, micro_batch, seed, mask_prob, device, None, rank, world_size), True
