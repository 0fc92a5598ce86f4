"""Builders for small, real model folders and data folders used across the tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nystromformer import shards

SPECIAL = {"bos": 0, "pad": 1, "eos": 2, "unk": 3, "mask": 4}
FIRST_WORD = 5


def write_synthetic_data(folder: Path, seq_len: int = 32, vocab_size: int = 64, num_train: int = 256,
                         num_dev: int = 64, seed: int = 0, shard_size: int = 100) -> Path:
    """A learnable corpus: each sequence counts up from a random start with stride 1 or 2 (mod the
    word range), so a masked token is predictable from its neighbours."""
    rng = np.random.default_rng(seed)
    words = vocab_size - FIRST_WORD
    meta = shards.make_meta(seq_len, vocab_size, "synthetic", SPECIAL)
    shards.write_meta(folder, meta)
    for split, count in (("train", num_train), ("dev", num_dev)):
        start = rng.integers(0, words, size=(count, 1))
        stride = rng.integers(1, 3, size=(count, 1))
        body = FIRST_WORD + (start + stride * np.arange(seq_len - 2)) % words
        seqs = np.concatenate([np.full((count, 1), SPECIAL["bos"]), body, np.full((count, 1), SPECIAL["eos"])], axis=1)
        names = []
        for i in range(0, count, shard_size):
            name = f"{split}-{i // shard_size:05d}.npy"
            shards.write_shard(folder / name, seqs[i:i + shard_size], meta)
            names.append(name)
        shards.write_split_index(folder, split, names)
    return folder


def tiny_config(**model_overrides) -> dict:
    model = {"vocab_size": 64, "max_seq_len": 32, "embedding_dim": 32, "transformer_dim": 32,
             "transformer_hidden_dim": 64, "num_layers": 2, "num_head": 4, "head_dim": 8, "dropout_prob": 0.1,
             "attn_type": "nystrom", "num_landmarks": 8, "conv_kernel_size": 5, "mixed_precision": False}
    model.update(model_overrides)
    return {"model": model,
            "pretraining_setting": {"batch_size": 16, "learning_rate": 2e-3, "warmup": 0.1, "batches_per_report": 1,
                                    "batches_per_epoch": 4, "epoch": 3, "validate_batches_per_epoch": 2},
            "gpu_setting": {"inst_per_gpu": 8},
            "model_checkpoints": "model", "data_folder": "../data"}


def write_model_dir(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def read_log(path: Path, kind: str = "train") -> list:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("type") == kind]
