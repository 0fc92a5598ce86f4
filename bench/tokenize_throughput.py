"""Tokenisation throughput and peak memory of the data pipeline, end to end through ``build-shards``.

Generates a synthetic corpus (Zipf-distributed words from the tokenizer's own vocabulary, in sentences and
documents) as partition files in a temporary folder, then times ``build_shards`` over it: reading partitions,
encoding, packing into sequences and writing shards. Reports tokens/s per core and peak RSS (this process and
its workers).

    python bench/tokenize_throughput.py --tokenizer ../shared/tokenizers/roberta-base --size-mb 200
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))
from nystromformer.data.build import DatasetSpec, build_shards  # noqa: E402


def word_list(tokenizer: Path) -> list:
    vocab = json.loads((tokenizer / "vocab.json").read_text())
    # Byte-level BPE marks a leading space with "Ġ"; whole words are those tokens that are alphabetic.
    words = [t[1:] for t in sorted(vocab, key=vocab.get) if t.startswith("Ġ") and re.fullmatch(r"[A-Za-z]+", t[1:])]
    return words[:30000]


def generate_corpus(folder: Path, words: list, size_mb: int, part_mb: int = 20, seed: int = 0) -> int:
    """Write ``size_mb`` MB of partitions; frequent words first in ``words`` get Zipf-like weights."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    vocab = np.array(words, dtype=object)
    written, part = 0, 0
    folder.mkdir(parents=True)
    while written < size_mb << 20:
        chunks, size = [], 0
        while size < min(part_mb, size_mb) << 20:
            picked = vocab[rng.choice(len(words), size=rng.integers(300, 1500), p=weights)]
            sentences = [" ".join(s).capitalize() + "." for s in np.array_split(picked, max(1, len(picked) // 14))]
            document = " ".join(sentences)
            chunks.append(document + "\n\n")
            size += len(document) + 2
        text = "".join(chunks)
        (folder / f"part-{part:05d}.txt").write_text(text)
        written += len(text.encode())
        part += 1
    return written


def peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024  # Linux reports KiB


def repeat_text(folder: Path, source: Path, size_mb: int, part_mb: int = 20) -> int:
    """Partitions of ``size_mb`` MB made by repeating real partition files (e.g. the Wikipedia sample)."""
    text = "".join(p.read_text() for p in sorted(source.glob("*.txt")))
    if not text:
        raise SystemExit(f"no partition .txt files in {source}")
    folder.mkdir(parents=True)
    part_text = (text * (-(-(part_mb << 20) // len(text))))[: part_mb << 20]
    part_text = part_text[: part_text.rfind("\n\n") + 2]
    written, part = 0, 0
    while written < size_mb << 20:
        (folder / f"part-{part:05d}.txt").write_text(part_text)
        written += len(part_text.encode())
        part += 1
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=Path(__file__).resolve().parents[2] / "shared/tokenizers/roberta-base")
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--text", type=Path, default=None,
                        help="a partition folder of real text to repeat (default: a generated Zipf corpus)")
    parser.add_argument("--modes", default="library,word-cache",
                        help="encoders to compare: library (the Rust backend alone), word-cache (the default path)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "bench"
        started = time.time()
        if args.text:
            size, kind = repeat_text(corpus, args.text, args.size_mb), f"{args.text.name} repeated"
        else:
            size, kind = generate_corpus(corpus, word_list(args.tokenizer), args.size_mb), "generated Zipf"
        print(f"prepared {size / 2**20:.0f} MB in {time.time() - started:.0f}s", file=sys.stderr)
        rss_before = peak_rss_mb()
        for mode in args.modes.split(","):
            # Workers are forked, so they inherit the switch.
            os.environ["NYSTROMFORMER_NO_WORD_CACHE"] = "1" if mode == "library" else ""
            started = time.perf_counter()
            stats = build_shards([DatasetSpec("bench", corpus)], Path(tmp) / f"shards-{mode}", str(args.tokenizer),
                                 seq_len=args.seq_len, workers=args.workers)
            elapsed = time.perf_counter() - started
            tokens = stats["datasets"]["bench"]["tokens"]
            rows.append(f"| {kind}, {size / 2**20:.0f} MB | {mode} | {args.workers} | {tokens / 1e6:.1f}M | "
                        f"{elapsed:.1f}s | {tokens / elapsed / 1e6:.2f}M | {tokens / elapsed / cores / 1e6:.2f}M | "
                        f"{peak_rss_mb():.0f} MB (before: {rss_before:.0f} MB) |")
    print(f"| corpus | encoder | workers | tokens | wall | tokens/s | tokens/s per core ({cores} cores) | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
