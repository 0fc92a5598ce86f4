"""Unified partitions: plain-text files of ~N words, documents separated by one blank line.

This is the format the paper's scripts wrote (~20M words per partition) and the input of both
``train-tokenizer`` and ``build-shards``. A folder holds ``part-00000.txt``, ``part-00001.txt``, ... and
``stats.json`` (what was read, kept, dropped and skipped).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Iterator, List, Optional

from tqdm import tqdm

from .. import atomic
from .readers import SkipLog

log = logging.getLogger("nystromformer.data")

PARTITION_GLOB = "part-*.txt"
WORDS_PER_PARTITION = 20_000_000


def partition_name(index: int) -> str:
    return f"part-{index:05d}.txt"


def partition_files(folder: Path) -> List[Path]:
    files = sorted(Path(folder).glob(PARTITION_GLOB))
    if not files:
        raise FileNotFoundError(f"{folder}: no partition files ({PARTITION_GLOB}); "
                                f"create them with `nystromformer preprocess`")
    return files


def write_partitions(documents: Iterable[str], output: Path, dataset: str, skips: SkipLog,
                     words_per_partition: int = WORDS_PER_PARTITION, min_words: int = 0,
                     inputs: Optional[List[str]] = None) -> dict:
    """Stream documents into partition files (each written atomically) and write ``stats.json``."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    stats = {"dataset": dataset, "inputs": inputs or [], "min_words": min_words,
             "words_per_partition": words_per_partition, "documents_read": 0, "documents_kept": 0,
             "documents_too_short": 0, "words": 0, "partitions": []}
    written: List[str] = []
    handle = None  # the open atomic writer of the current partition
    context = None
    words_in_part = 0
    progress = tqdm(documents, desc=f"preprocess {dataset}", unit=" docs")
    try:
        for document in progress:
            stats["documents_read"] += 1
            words = len(document.split())
            if words == 0 or words < min_words:
                stats["documents_too_short"] += 1
                continue
            if handle is None:
                name = partition_name(len(written))
                context = atomic.atomic_open(output / name, "w")
                handle = context.__enter__()
                written.append(name)
                words_in_part = 0
            handle.write(document + "\n\n")
            words_in_part += words
            stats["documents_kept"] += 1
            stats["words"] += words
            if words_in_part >= words_per_partition:
                context.__exit__(None, None, None)
                handle = context = None
        if context is not None:
            context.__exit__(None, None, None)
            context = None
    except BaseException as e:
        if context is not None:  # removes the temporary file; finished partitions stay
            context.__exit__(type(e), e, e.__traceback__)
        raise
    # Partitions left by an earlier run with a smaller partition size would be read as data: remove them.
    for stale in sorted(output.glob(PARTITION_GLOB)):
        if stale.name not in written:
            log.info("removing %s (left by an earlier run)", stale)
            stale.unlink()
    stats["partitions"] = written
    stats["skipped"] = skips.as_dict()
    atomic.write_json(output / "stats.json", stats)
    log.info("%s: kept %d of %d documents (%d words) in %d partitions; %d too short; skipped %s",
             dataset, stats["documents_kept"], stats["documents_read"], stats["words"], len(written),
             stats["documents_too_short"], dict(skips.counts) or "nothing")
    return stats


def read_partition(path: Path) -> Iterator[str]:
    """Documents of one partition file, streamed (blank lines separate documents)."""
    lines: List[str] = []
    # newline="\n": a lone \r inside a document is text, not a line break (universal newlines would turn
    # "\r\r" into a blank line, i.e. a document boundary).
    with open(path, encoding="utf-8", newline="\n") as f:
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
    if lines:
        yield "".join(lines).rstrip("\n")
