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

import weakref
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


class BufferWrites:
    """Tells whether a buffer was written since it was last read to the host, so a host copy of its value is read
    back only then (a state dict loaded, a DDP broadcast), not at every pass: by the tensor's version counter and by
    which tensor it is — ``Module.to``/``_apply`` replace a buffer by a new tensor whose counter starts again at 0,
    so a value loaded on the CPU and moved to the GPU would otherwise look unwritten."""

    def __init__(self, buffer: torch.Tensor):
        self.read(buffer)

    def read(self, buffer: torch.Tensor) -> None:
        self._tensor, self._version = weakref.ref(buffer), buffer._version

    def written(self, buffer: torch.Tensor) -> bool:
        return self._tensor() is not buffer or buffer._version != self._version


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
