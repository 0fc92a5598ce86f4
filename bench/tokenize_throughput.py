"""Tokenisation throughput and peak memory of the data pipeline, end to end through ``build-shards``.

Generates a synthetic corpus (Zipf-distributed words from the tokenizer's own vocabulary, in sentences and
documents) as partition files in a temporary folder, then times ``build_shards`` over it: reading partitions,
encoding, packing into sequences and writing shards. Each mode (--modes) runs in a process of its own, forked
for it, so that no mode's memory is counted in another's. Reports tokens/s, tokens/s per core used (the
processes that encode at once: min(--workers, partition files, cores); --workers 1 encodes in the mode's process,
on one core) and peak RSS: the most the mode's process and its workers held together, their resident memory
summed (pages they share counted in each), sampled every 50 ms; "at start" is the mode's process as forked.

    python bench/tokenize_throughput.py --tokenizer ../shared/tokenizers/roberta-base --size-mb 200

A mode that fails is named under the table, the others still run, and the exit status is 1; stopped (SIGTERM or
Ctrl-C), the script prints the rows it measured and exits 130 (bench/time_limit.py).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))
from nystromformer.data.build import DatasetSpec, build_shards  # noqa: E402

from time_limit import failure, finish, stop_on_sigterm  # noqa: E402

MODES = {"library": "the Rust backend alone", "word-cache": "the default path"}
SAMPLE_S = 0.05  # seconds between two samples of a mode's memory
PAGE = os.sysconf("SC_PAGE_SIZE")


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


def descendants(pid: int) -> list:
    """The processes under ``pid`` (its children, theirs, ...), from Linux's /proc/PID/task/TID/children."""
    found, stack = [], [pid]
    while stack:
        for task in Path(f"/proc/{stack.pop()}/task").glob("*/children"):
            try:
                children = [int(c) for c in task.read_text().split()]
            except OSError:  # the thread or process ended meanwhile
                continue
            found += children
            stack += children
    return found


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and every process under it, summed (a page two of them share counts twice)."""
    total = 0
    for each in [pid, *descendants(pid)]:
        try:
            total += int(Path(f"/proc/{each}/statm").read_text().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):  # ended meanwhile
            pass
    return total


def _mode_child(send, mode: str, corpus: Path, output: Path, tokenizer: Path, seq_len: int, workers: int) -> None:
    """In the mode's forked process: build the shards, send ("ok", tokens, seconds) or ("error", type, message)."""
    try:
        # Workers are spawned with this process's environment, so they see the switch.
        os.environ["NYSTROMFORMER_NO_WORD_CACHE"] = "1" if mode == "library" else ""
        started = time.perf_counter()
        stats = build_shards([DatasetSpec("bench", corpus)], output, str(tokenizer), seq_len=seq_len, workers=workers)
        send.send(("ok", stats["datasets"]["bench"]["tokens"], time.perf_counter() - started))
    except BaseException as error:  # noqa: BLE001 - reported by the parent as the mode's failure
        send.send(("error", type(error).__name__, str(error)))


class ModeFailed(Exception):
    pass


def measure_mode(mode: str, corpus: Path, output: Path, args) -> tuple:
    """(tokens, seconds, peak bytes, bytes at start) of one mode, run in a forked process whose memory and its
    workers' is sampled until it is done; ModeFailed when it failed. Stopped, it kills the process and its workers."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    proc = context.Process(target=_mode_child, args=(send, mode, corpus, output, args.tokenizer, args.seq_len,
                                                     args.workers))
    proc.start()
    send.close()
    try:
        start = peak = tree_rss_bytes(proc.pid)
        while not receive.poll(SAMPLE_S):
            peak = max(peak, tree_rss_bytes(proc.pid))
        try:
            result = receive.recv()
        except EOFError:
            proc.join()
            result = ("error", "the mode's process ended", f"exit status {proc.exitcode}")
    except BaseException:
        for each in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(each, 9)
            except OSError:
                pass
        raise
    proc.join()
    if result[0] != "ok":
        raise ModeFailed(f"{result[1]}: {result[2]}")
    return result[1], result[2], peak, start


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


def validate_args(ap, args) -> None:
    unknown = [mode for mode in args.modes.split(",") if mode not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {', '.join(map(repr, unknown))}; the modes are {', '.join(MODES)} "
                 f"(comma-separated)")
    if args.workers < 1:
        ap.error(f"--workers must be at least 1, got {args.workers}")
    if args.size_mb < 1:
        ap.error(f"--size-mb must be at least 1, got {args.size_mb}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=Path(__file__).resolve().parents[2] / "shared/tokenizers/roberta-base")
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--text", type=Path, default=None,
                        help="a partition folder of real text to repeat (default: a generated Zipf corpus)")
    parser.add_argument("--modes", default="library,word-cache",
                        help="encoders to compare, comma-separated: " + ", ".join(f"{k} ({v})" for k, v in MODES.items()))
    args = parser.parse_args()
    validate_args(parser, args)
    stop_on_sigterm()
    cores = os.cpu_count() or 1
    failures, where = [], "the corpus's preparation"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            corpus = Path(tmp) / "bench"
            started = time.time()
            if args.text:
                size, kind = repeat_text(corpus, args.text, args.size_mb), f"{args.text.name} repeated"
            else:
                size, kind = generate_corpus(corpus, word_list(args.tokenizer), args.size_mb), "generated Zipf"
            print(f"prepared {size / 2**20:.0f} MB in {time.time() - started:.0f}s", file=sys.stderr)
            used = min(args.workers, len(list(corpus.glob("*.txt"))), cores)  # build_shards' processes at once
            print("| corpus | encoder | workers | tokens | wall | tokens/s | tokens/s per core used | "
                  "peak RSS, mode's process + workers |")
            print("|---|---|---|---|---|---|---|---|", flush=True)
            for mode in args.modes.split(","):
                where = f"the {mode} mode"
                try:
                    tokens, elapsed, peak, start = measure_mode(mode, corpus, Path(tmp) / f"shards-{mode}", args)
                except ModeFailed as error:
                    failures.append(failure(mode, error))
                    print(f"| {kind}, {size / 2**20:.0f} MB | {mode} | {args.workers} |" + " n/a |" * 5, flush=True)
                    continue
                print(f"| {kind}, {size / 2**20:.0f} MB | {mode} | {args.workers} | {tokens / 1e6:.1f}M | "
                      f"{elapsed:.1f}s | {tokens / elapsed / 1e6:.2f}M | {tokens / elapsed / used / 1e6:.2f}M "
                      f"({used} of {cores} cores) | {peak / 2**20:.0f} MB (at start: {start / 2**20:.0f} MB) |",
                      flush=True)
            where = None
        except KeyboardInterrupt:
            pass  # where names the step under way
    finish(failures, where)


if __name__ == "__main__":
    main()
