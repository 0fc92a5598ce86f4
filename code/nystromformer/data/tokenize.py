"""Tokenisation: encoding partitions with any Hugging Face tokenizer, and training a byte-level BPE.

Byte-level BPE tokenizers of the GPT-2/RoBERTa kind (no normaliser, ByteLevel pre-tokenizer without prefix
space, BPE model) go through ``WordCachedBPE``: the pre-tokenizer's regex splits a document into words and each
distinct word is encoded once by the tokenizer's own BPE model, then looked up — ~3x faster than the Rust
pipeline on real text, with the same ids (checked id for id at start-up on a probe text, and in the tests on
real Wikipedia text and mixed-script Unicode). Any other tokenizer, and any document containing a special-token
string, goes through the Rust backend's ``encode_batch_fast``. Memory stays bounded: partitions are read and
encoded a batch of documents at a time, and the word cache has a fixed capacity.
"""
from __future__ import annotations

import json
import logging
import os
import unicodedata
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence

import numpy as np
from tqdm import tqdm

from .. import atomic
from .partitions import PartitionError, partition_files, read_partition

log = logging.getLogger("nystromformer.data")

# RoBERTa's convention: <s>=0 <pad>=1 </s>=2 <unk>=3, <mask> is the last id of the vocabulary.
ROBERTA_SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]
MASK_TOKEN = "<mask>"
MAX_VOCAB = 1 << 24  # far beyond any corpus's useful vocabulary; much larger asks the trainer for terabytes
BATCH_CHARS = 1 << 20  # encode ~1 MB of text per call: large enough to keep the Rust threads busy


# GPT-2's pre-tokenizer pattern, which the ByteLevel pre-tokenizer of `tokenizers` uses (use_regex=True).
BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PROBE_TEXTS = ("Hello world!  It's 3.14159 -- naïve café, 東京 and Ελληνικά; tabs\tand\nnew lines,   spaces "
               "\u200d emoji 👍🏽 and don't we'll I'm they've",
               # Letters of recent Unicode versions: unassigned (so sent to the library) in older Python tables.
               "\u0558's", "\U0001E030's")
WORD_CACHE_CAPACITY = 1 << 20  # distinct words kept (~100 MB at most); the cache restarts when full


def bytes_to_unicode() -> List[str]:
    """GPT-2's reversible byte -> printable character table, indexed by byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


class WordCachedBPE:
    """Byte-level BPE with a per-word cache in front of the tokenizer's own BPE model."""

    def __init__(self, backend):
        import regex

        self.model = backend.model
        self.split = regex.compile(BYTE_LEVEL_PATTERN).findall
        self.byte_chars = bytes_to_unicode()
        self.cache: dict = {}
        self.special = [t.content for t in backend.get_added_tokens_decoder().values()]

    @staticmethod
    def applies_to(backend) -> bool:
        config = json.loads(backend.to_str())
        pre = config.get("pre_tokenizer") or {}
        return (config.get("normalizer") is None and config["model"].get("type") == "BPE"
                and config["model"].get("dropout") is None and not config["model"].get("byte_fallback")
                and pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space") and pre.get("use_regex", True))

    def has_special_text(self, document: str) -> bool:
        return any(token in document for token in self.special)

    def encode_word(self, word: str) -> tuple:
        """The word's ids; () when the word holds a code point unassigned in Python's Unicode tables: the
        `regex` package may know it as a letter where the tokenizer's older tables do not, and split
        differently, so such documents go to the library."""
        if not word.isascii() and any(unicodedata.category(c) == "Cn" for c in word):
            return ()
        mapped = "".join([self.byte_chars[b] for b in word.encode("utf-8")])
        return tuple(token.id for token in self.model.tokenize(mapped))

    def encode(self, document: str) -> Optional[List[int]]:
        """Ids of the document, or None when it must go through the library (see ``encode_word``)."""
        ids: List[int] = []
        cache, extend = self.cache, ids.extend
        for word in self.split(document):
            word_ids = cache.get(word)
            if word_ids is None:
                if len(cache) >= WORD_CACHE_CAPACITY:
                    cache.clear()
                word_ids = cache[word] = self.encode_word(word)
            if not word_ids:
                return None
            extend(word_ids)
        return ids


class DocumentEncoder:
    """Documents -> token id arrays (no special tokens): the word-cached BPE where it gives the tokenizer's
    own ids, the Rust backend otherwise."""

    def __init__(self, tokenizer, allow_word_cache: Optional[bool] = None):
        from tokenizers import Tokenizer
        self.tokenizer = tokenizer
        # Corpus text that spells a special token ("<pad>", "</s>" in an article about markup) is text: encoded as
        # its characters, never as the special id, which would be a document boundary (</s>), masked out of
        # attention (<pad>) or a mask the model is asked to fill (<mask>). As fairseq's RoBERTa preprocessing did;
        # tokenizer(text) would not (split_special_tokens=True does). A copy: the caller's tokenizer is unchanged.
        self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self.backend.encode_special_tokens = True
        # A tokenizer.json may save truncation (e.g. to 512) and padding, which the copy keeps: documents would be
        # cut short, or <pad> ids packed into the stream. tokenizer(text) overrides both per call; so do we, once.
        self.backend.no_truncation()
        self.backend.no_padding()
        self.word_cache = None
        if allow_word_cache is None:  # NYSTROMFORMER_NO_WORD_CACHE=1 forces the Rust backend (for comparisons)
            allow_word_cache = os.environ.get("NYSTROMFORMER_NO_WORD_CACHE", "0") in ("", "0")
        if allow_word_cache and WordCachedBPE.applies_to(self.backend):
            cache = WordCachedBPE(self.backend)
            # A probe the word cache declines (None) goes to the library anyway; one it encodes must agree.
            if all(cache.encode(t) in (None, self._encode_with_backend([t])[0]) for t in PROBE_TEXTS):
                self.word_cache = cache
            else:
                log.warning("the word-cached BPE disagrees with the tokenizer on a probe text; using the Rust backend")

    def _encode_with_backend(self, documents: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self.backend.encode_batch_fast(list(documents), add_special_tokens=False)]

    def encode(self, documents: Sequence[str]) -> List[np.ndarray]:
        if self.word_cache is None:
            return [np.asarray(ids, dtype=np.int64) for ids in self._encode_with_backend(documents)]
        out = []
        for document in documents:
            ids = None if self.word_cache.has_special_text(document) else self.word_cache.encode(document)
            if ids is None:
                ids = self._encode_with_backend([document])[0]
            out.append(np.asarray(ids, dtype=np.int64))
        return out

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
    # Byte-level BPE starts from the 256 bytes; the 5 RoBERTa special tokens come on top. Below that the trainer
    # silently gives 261 tokens anyway; far above the corpus's words it stops early (logged below).
    smallest = 256 + len(ROBERTA_SPECIAL_TOKENS) + 1  # + <mask>
    if not smallest <= vocab_size <= MAX_VOCAB:
        raise PartitionError(f"--vocab-size: must be from {smallest} (the 256 bytes and the 5 special tokens) to "
                             f"{MAX_VOCAB}, got {vocab_size}")
    if min_frequency < 1:
        raise PartitionError(f"--min-frequency: must be at least 1, got {min_frequency}")
    for folder in inputs:  # a bad input fails here, before anything is written
        partition_files(Path(folder))
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
    if len(ordered) < vocab_size:
        log.warning("the corpus has too few distinct words for --vocab-size %d: the tokenizer has %d tokens",
                    vocab_size, len(ordered))
    return output
