"""Builders for small, real model folders and data folders used across the tests."""
from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class WeightCasts(TorchDispatchMode):
    """While active, counts the casts to bf16 of every tensor, by storage and by shape; then how often each of a
    model's parameters was cast (``of_parameters``) and each layer's joined q, k, v weight (``of_joined_qkv``: not a
    parameter, so found by its shape)."""

    def __init__(self):
        super().__init__()
        self.by_storage, self.by_shape = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            self.by_storage[args[0].untyped_storage().data_ptr()] += 1
            self.by_shape[tuple(args[0].shape)] += 1
        return func(*args, **kwargs)

    def of_parameters(self, model) -> dict:
        return {name: self.by_storage[p.untyped_storage().data_ptr()] for name, p in model.named_parameters()}

    def of_joined_qkv(self, model) -> int:
        cfg = model.config
        return self.by_shape[(3 * cfg.num_head * cfg.head_dim, cfg.transformer_dim)]


def run_at_once(commands: list[list[str]], envs: list[dict], cwd: Path, timeout: float) -> list[tuple[int, str, str]]:
    """Run the commands, each in its environment, as concurrent processes (the suite itself runs in one process;
    this uses the machine's other cores) and return each one's (exit status, stdout, stderr); all are killed if
    one overruns."""
    procs = [subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command, env in zip(commands, envs, strict=True)]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)]
