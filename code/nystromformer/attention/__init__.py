"""Attention variants behind one small interface.

Every variant is an ``nn.Module`` built from the model config with ``forward(q, k, v, mask)``:
``q, k, v`` are ``(batch, heads, seq_len, head_dim)``, ``mask`` is ``(batch, seq_len)`` with 1 for real
tokens and 0 for padding, and the result has the shape of ``v``. Scaling by 1/sqrt(head_dim) is the
variant's job. Variants register themselves by ``attn_type`` name.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch.nn as nn

ATTENTION_REGISTRY: Dict[str, Callable[..., nn.Module]] = {}


def register(name: str):
    def wrap(cls):
        ATTENTION_REGISTRY[name] = cls
        return cls
    return wrap


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
