"""Tokenisation: encoding partitions with any Hugging Face tokenizer, and training a byte-level BPE.

Encoding goes through the tokenizer's Rust backend with ``encode_batch_fast`` (no offset mappings): the same ids as
``tokenizer(text)``, ~1.4x faster. Memory stays bounded: a partition is read and encoded a batch of documents at a
time, whatever the corpus size.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence

import numpy as np
from tqdm import tqdm

from .. import atomic
from .partitions import partition_files, read_partition

log = logging.getLogger("nystromformer.data")

# RoBERTa's convention: <s>=0 <pad>=1 </s>=2 <unk>=3, <mask> is the last id of the vocabulary.
ROBERTA_SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]
MASK_TOKEN = "<mask>"
BATCH_CHARS = 1 << 20  # encode ~1 MB of text per call: large enough to keep the Rust threads busy


class DocumentEncoder:
    """Documents -> token id arrays (no special tokens), via the tokenizer's Rust backend."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer

    def encode(self, documents: Sequence[str]) -> List[np.ndarray]:
        encodings = self.backend.encode_batch_fast(list(documents), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def encode_partition(self, path: Path) -> Iterator[np.ndarray]:
        """Token ids of each document of a partition file, in order, streamed in batches of ~1 MB."""
        batch: List[str] = []
        chars = 0
        for document in read_partition(path):
            batch.append(document)
            chars += len(document)
            if chars >= BATCH_CHARS:
                yield from self.encode(batch)
                batch, chars = [], 0
        if batch:
            yield from self.encode(batch)


def iter_documents(folders: Iterable[Path]) -> Iterator[str]:
    for folder in folders:
        for path in tqdm(partition_files(Path(folder)), desc=f"read {folder}", unit=" partitions", leave=False):
            yield from read_partition(path)


def train_tokenizer(inputs: Sequence[Path], output: Path, vocab_size: int = 50265, min_frequency: int = 2) -> Path:
    """Train a byte-level BPE on partition folders and save it so ``load_tokenizer(output)`` loads it.

    The trainer streams documents (its memory is the word-count table, not the corpus) and counts words on all
    cores. ``<mask>`` is appended after training so it gets the last id, as in RoBERTa.
    """
    from tokenizers import ByteLevelBPETokenizer

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(iter_documents(inputs), vocab_size=vocab_size - 1, min_frequency=min_frequency,
                            special_tokens=ROBERTA_SPECIAL_TOKENS, show_progress=True)
    vocab = bpe.get_vocab()
    vocab[MASK_TOKEN] = len(vocab)
    ordered = dict(sorted(vocab.items(), key=lambda item: item[1]))
    atomic.write_text(output / "vocab.json", json.dumps(ordered, ensure_ascii=False))
    # merges.txt in the format RoBERTa ships (version header, one "left right" pair per line).
    model = json.loads(bpe._tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    atomic.write_text(output / "merges.txt", "#version: 0.2\n" + "".join(m + "\n" for m in merges))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>",
               "pad_token": "<pad>", "cls_token": "<s>", "mask_token": MASK_TOKEN}
    atomic.write_json(output / "special_tokens_map.json", special)
    atomic.write_json(output / "tokenizer_config.json",
                      {"tokenizer_class": "RobertaTokenizer", "add_prefix_space": False, "trim_offsets": True,
                       "model_max_length": 1_000_000, **special})
    log.info("trained a byte-level BPE with %d tokens into %s", len(ordered), output)
    return output
