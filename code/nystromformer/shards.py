"""The one shard format for pretraining data.

A data folder holds:
- ``meta.json``: ``{"format": "nystromformer-shards", "version": 1, "max_seq_len", "vocab_size", "dtype",
  "tokenizer", "special_tokens": {"bos", "eos", "pad", "mask", "unk"}}``, plus what ``build-shards`` records of
  how it was built: "datasets" (name -> sampling ratio), "dev_fraction", "dev_run", "dev_run_unit" (tokens per
  unit of dev_run), "special_token_text" ("as text"), "seed", "shard_size", and for a tokenizer folder
  "tokenizer_files_sha256" and "tokenizer_relative" (its path from the data folder); a resumed pretraining run
  checks them (those listed in resume.DATA_META_KEYS)
- ``train.json`` and ``dev.json``: ``{"num_sequences": N, "shards": [{"file": "wiki--part-00000-train-00000.npy",
  "num_sequences": n}, ...]}`` (file names relative to the folder; ``build-shards`` names them
  ``<dataset>--<partition>-<split>-<k>.npy``, see ``data/build.py``; any name works)
- the shards: numpy ``.npy`` arrays of token ids, shape (num_sequences, max_seq_len), uint16 when the
  vocabulary fits, else uint32. Read memory-mapped, never unpickled.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence, Union

import numpy as np

from . import atomic
from .errors import UserError

FORMAT_NAME = "nystromformer-shards"
FORMAT_VERSION = 1
SPLITS = ("train", "dev")
SPECIAL_TOKEN_NAMES = ("bos", "eos", "pad", "mask", "unk")


class ShardError(UserError, ValueError):
    """A data folder that does not follow the shard format; the message names the file."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def make_meta(max_seq_len: int, vocab_size: int, tokenizer: str, special_tokens: Dict[str, int], **extra) -> dict:
    missing = [n for n in SPECIAL_TOKEN_NAMES if n not in special_tokens]
    if missing:
        raise ShardError(f"special_tokens is missing {', '.join(missing)}")
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "max_seq_len": int(max_seq_len),
            "vocab_size": int(vocab_size), "dtype": dtype_for_vocab(vocab_size).name, "tokenizer": str(tokenizer),
            "special_tokens": {k: int(v) for k, v in special_tokens.items()}, **extra}


def write_meta(folder: Union[str, Path], meta: dict) -> None:
    atomic.write_json(Path(folder) / "meta.json", meta)


def write_shard(path: Union[str, Path], sequences: np.ndarray, meta: dict) -> None:
    """Atomically write one shard after checking it against the folder's metadata."""
    sequences = np.asarray(sequences)
    if sequences.ndim != 2 or sequences.shape[1] != meta["max_seq_len"]:
        raise ShardError(f"{path}: shard must have shape (n, {meta['max_seq_len']}), got {sequences.shape}")
    if sequences.size and (sequences.min() < 0 or sequences.max() >= meta["vocab_size"]):
        raise ShardError(f"{path}: token ids must lie in [0, {meta['vocab_size']})")
    atomic.save_npy(path, sequences.astype(meta["dtype"], copy=False))


def write_split_index(folder: Union[str, Path], split: str, shard_files: Sequence[str]) -> None:
    """Write ``<split>.json`` listing shard files (relative to the folder) with their row counts."""
    folder = Path(folder)
    entries = []
    for name in shard_files:
        rows = np.load(folder / name, mmap_mode="r", allow_pickle=False).shape[0]
        entries.append({"file": str(name), "num_sequences": int(rows)})
    atomic.write_json(folder / f"{split}.json",
                      {"num_sequences": sum(e["num_sequences"] for e in entries), "shards": entries})


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardError(f"{path}: unreadable ({e}); rebuild the folder with `nystromformer build-shards`") from None


def read_meta(folder: Union[str, Path]) -> dict:
    path = Path(folder) / "meta.json"
    if not path.is_file():
        raise ShardError(f"{path}: missing; a data folder needs meta.json, train.json and dev.json "
                         f"(build one with `nystromformer build-shards`)")
    meta = _read_json(path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ShardError(f"{path}: not a {FORMAT_NAME} folder (format="
                         f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != FORMAT_VERSION:
        raise ShardError(f"{path}: shard format version {meta.get('version')} is not supported "
                         f"(this code reads version {FORMAT_VERSION})")
    # The fields every reader relies on, checked here so that a hand-edited file is named, not a KeyError later
    for key in ("max_seq_len", "vocab_size"):
        if not (isinstance(meta.get(key), int) and not isinstance(meta[key], bool) and meta[key] >= 1):
            raise ShardError(f"{path}: {key}: expected a positive integer, got {json.dumps(meta.get(key))}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise ShardError(f"{path}: dtype: expected \"uint16\" or \"uint32\", got {json.dumps(meta.get('dtype'))}")
    special = meta.get("special_tokens")
    if not isinstance(special, dict):
        raise ShardError(f"{path}: special_tokens: expected an object with {', '.join(SPECIAL_TOKEN_NAMES)}")
    bad = [n for n in SPECIAL_TOKEN_NAMES if not (isinstance(special.get(n), int) and 0 <= special[n] <
                                                  meta["vocab_size"])]
    if bad:
        raise ShardError(f"{path}: special_tokens: {', '.join(bad)} missing, or not a token id below vocab_size "
                         f"({meta['vocab_size']})")
    return meta


class ShardedSequences:
    """All sequences of one split, addressed by a global row index, memory-mapped."""

    def __init__(self, folder: Union[str, Path], split: str):
        self.split = split
        if split not in SPLITS:
            raise ShardError(f"unknown split {split!r} (expected one of {SPLITS})")
        self.folder = Path(folder)
        self.meta = read_meta(self.folder)
        index_path = self.folder / f"{split}.json"
        if not index_path.is_file():
            raise ShardError(f"{index_path}: missing")
        index = _read_json(index_path)
        if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
            raise ShardError(f"{index_path}: not a split index (no \"shards\" list)")
        for i, entry in enumerate(index["shards"]):
            if not (isinstance(entry, dict) and isinstance(entry.get("file"), str)
                    and isinstance(entry.get("num_sequences"), int)):
                raise ShardError(f"{index_path}: shards[{i}]: expected {{\"file\": name, \"num_sequences\": n}}, "
                                 f"got {json.dumps(entry)[:80]}")
        self.arrays: List[np.ndarray] = []
        self.shard_files = [entry["file"] for entry in index["shards"]]
        for entry in index["shards"]:
            path = self.folder / entry["file"]
            if not path.is_file():
                raise ShardError(f"{index_path}: lists {entry['file']}, which does not exist")
            try:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as e:  # truncated, not .npy, or object (pickled) data
                raise ShardError(f"{path}: not a readable .npy shard ({e})") from None
            if array.dtype != np.dtype(self.meta["dtype"]):
                raise ShardError(f"{path}: dtype {array.dtype}, but {self.folder / 'meta.json'} says "
                                 f"{self.meta['dtype']}")
            if array.ndim != 2 or array.shape[1] != self.meta["max_seq_len"] or array.shape[0] != entry["num_sequences"]:
                raise ShardError(f"{path}: shape {array.shape} does not match {index_path} "
                                 f"({entry['num_sequences']} x {self.meta['max_seq_len']})")
            self.arrays.append(array)
        self.offsets = np.cumsum([0] + [a.shape[0] for a in self.arrays])
        self.seq_len = int(self.meta["max_seq_len"])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def rows(self, indices: Sequence[int]) -> np.ndarray:
        """Rows at the given global indices, as int64, in the given order."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), self.seq_len), dtype=np.int64)
        shard_of = np.searchsorted(self.offsets, indices, side="right") - 1
        for s in np.unique(shard_of):
            sel = np.nonzero(shard_of == s)[0]
            out[sel] = self.arrays[s][indices[sel] - self.offsets[s]]
            # An id past the vocabulary would index past the embedding table (a device assert on a GPU).
            if out[sel].max(initial=0) >= self.meta["vocab_size"]:
                raise ShardError(f"{self.folder / self.shard_files[s]}: token id {int(out[sel].max())} is not "
                                 f"below vocab_size {self.meta['vocab_size']} (meta.json)")
        return out
