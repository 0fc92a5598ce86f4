"""Attention variants behind one small interface.

Every variant is an ``nn.Module`` built from the model config with ``forward(q, k, v, mask)``:
``q, k, v`` are ``(batch, heads, seq_len, head_dim)``, ``mask`` is ``(batch, seq_len)`` with 1 for real
tokens and 0 for padding, or None when no row has padding (pretraining's full-length rows: variants that can,
skip the masking work; the others call ``key_padding_mask``), and the result has the shape of ``v``. Scaling
by 1/sqrt(head_dim) is the variant's job. Variants register themselves by ``attn_type`` name. A variant that
never reads ``k`` says so with ``reads_keys = False`` (the model then passes ``q`` as ``k`` and skips the key
projection). A variant whose outputs depend on their batch mates (Nyström's ``"original"`` pseudo-inverse init, a
max over the batch) has an ``init_rows`` attribute: when set, the mates are each group of that many consecutive
rows, so that one pass over several groups computes what a pass per group would (``model.set_batch_groups``).
A variant with host-side work per pass (Performer's redraw count, BigBird's block layout, Reformer's evaluation
rotation) does it in ``prepare(seq_len, device)``, which the encoder calls once per forward pass before any layer,
eagerly (``torch.compiler.disable``): in ``forward`` it would split a compiled graph, and gradient checkpointing
runs ``forward`` again in the backward. ``forward`` works without it (a direct call), with the current state
or drawing what it lacks.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn as nn

ATTENTION_REGISTRY: Dict[str, Callable[..., nn.Module]] = {}
# Variants whose real tokens' outputs change with the *amount* of padding (docs/attention.md, "padding"): Nyström's
# segment-mean landmarks move with the padded length (and at most num_landmarks positions it is exact softmax),
# Reformer's bucket count and BigBird's random blocks (drawn per block count) follow it. Fine-tuning pads their
# batches to one fixed length, as the authors' GLUE runs did, so that an example's prediction does not depend on the
# longest example of its batch (tests/test_attention_variants.py checks this set against every variant).
PADDING_AMOUNT_MATTERS = frozenset({"nystrom", "reformer", "bigbird"})


def register(name: str):
    def wrap(cls):
        ATTENTION_REGISTRY[name] = cls
        return cls
    return wrap


def key_padding_mask(mask: Optional[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """The (batch, seq_len) mask, all ones when ``mask`` is None (no padding)."""
    if mask is not None:
        return mask
    return torch.ones(q.shape[0], q.shape[-2], dtype=q.dtype, device=q.device)


def build_attention(model_config) -> nn.Module:
    try:
        cls = ATTENTION_REGISTRY[model_config.attn_type]
    except KeyError:
        raise ValueError(f"model.attn_type: unknown attention {model_config.attn_type!r}; "
                         f"known: {', '.join(sorted(ATTENTION_REGISTRY))}") from None
    return cls(model_config)


# Import the variants so they register.
from . import (bigbird, linear, linformer, linformer_revisited, longformer, nystrom, performer, reformer,  # noqa: E402,F401
               softmax)
