"""Partitions -> token shards in the format of ``nystromformer/shards.py``.

Per input partition file (the unit of work and of resumption):
- documents are encoded and concatenated, with ``</s>`` between consecutive documents (as RoBERTa's
  FULL-SENTENCES packing: a sequence may cross a document boundary, the separator marks it);
- the token stream is cut into contiguous blocks of ``seq_len - 2`` tokens, each wrapped as ``<s> block </s>``,
  so every sequence has exactly ``seq_len`` ids; the tail shorter than a block is dropped (and counted);
- each sequence is kept with probability = the dataset's sampling ratio (a generator seeded by (seed, dataset,
  file name));
- the dev split goes by runs of the file's token stream, ``dev_run`` × DEV_RUN_UNIT (510) tokens each — ``dev_run``
  sequences at seq_len 512 (default 8,192, the paper's output files) — each sent to dev with probability
  ``dev_fraction`` by a second generator. Runs are measured in tokens, not in this build's sequences, so builds
  of every length put the same text in dev: a 4096 model warm-started from a 512 one is evaluated on text the
  512 model never trained on. A sequence whose text lies partly in a dev run and partly in a train run goes to
  neither split (counted as ``sequences_across_splits``; none at 512, where runs end on sequence boundaries).
  So the result does not depend on the number of workers or on which files were built in an earlier run;
- its shards ``<dataset>--<part>-<split>-<k>.npy`` (at most ``shard_size`` rows) are written atomically, then a
  manifest entry ``manifest/<dataset>--<part>.json``. A re-run skips files whose entry exists and whose source
  is unchanged; an interrupted run redoes only the files without an entry.
The partition files are listed once, with their size, mtime and inode, and opened later by path: a ``preprocess``
that swaps the folder in meanwhile would mix old and new files, so each file is checked against its listing before
and after it is encoded, and all of them before the indexes are written; a change is an error (rerun when
``preprocess`` has finished). The manifest records size and mtime only: ``preprocess`` rewrites a partition whose
content did not change as a new file (a new inode) with the old mtime, and that file stays finished.
Finally ``train.json``/``dev.json``, ``meta.json`` and ``stats.json`` are (re)written only when they change, so a
re-run of a finished build touches no file. Every input (partition folders, tokenizer, settings against an existing
``meta.json``) is checked before the first file is written, so a mistyped command leaves no trace; and a new folder's
``meta.json`` comes with its first shard or manifest entry, so neither does one failing on its first partition file.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
from tqdm import tqdm

from .. import atomic
from ..errors import UserError
from ..shards import make_meta, write_meta, write_shard, write_split_index
from ..tokenizer import load_tokenizer, special_token_ids, tokenizer_files_digest
from .partitions import partition_files
from .tokenize import DocumentEncoder

log = logging.getLogger("nystromformer.data")

MANIFEST_DIR = "manifest"
SHARD_SIZE = 16384  # sequences per shard: 16 MB at seq_len 512 (uint16), 128 MB at 4096
DEV_RUN = 8192  # runs of this many units go to dev or train together: the paper's output files held 8,192 sequences
# Tokens per unit of dev_run, at every seq_len: a 512-token sequence's text. At seq_len 512 a run is dev_run
# sequences as before; at 4096 the same text (and at 128, ...), so no length's dev text is another's train text.
DEV_RUN_UNIT = 510


class BuildError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    folder: Path
    ratio: float = 1.0


def parse_dataset(arg: str) -> DatasetSpec:
    """``<partitions dir>[:<sampling ratio>]``; the dataset is named after the folder."""
    folder, ratio = arg, 1.0
    # A trailing ":<number>" is a ratio; any other colon is part of the path.
    if m := re.fullmatch(r"(.+):([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)", arg):
        folder, ratio = m.group(1), float(m.group(2))
    elif ":" in arg and not Path(arg).exists() and Path(arg.rpartition(":")[0]).is_dir():
        raise BuildError(f"{arg}: {arg.rpartition(':')[2]!r} is not a sampling ratio (a number in (0, 1], e.g. "
                         f"{arg.rpartition(':')[0]}:0.333)")
    if not 0 < ratio <= 1:
        raise BuildError(f"{arg}: sampling ratio must be in (0, 1], got {ratio}")
    return DatasetSpec(Path(folder).resolve().name, Path(folder), ratio)


def _identity(path: Path) -> Optional[tuple]:
    """What tells a partition file from a rewritten one: size, mtime, device and inode (None: it is gone)."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns, stat.st_dev, stat.st_ino


@dataclass(frozen=True)
class Task:
    dataset: str
    ratio: float
    source: Path
    listed: Optional[tuple] = None  # the source's _identity when the build listed it (None: not checked)

    @classmethod
    def from_listing(cls, dataset: str, ratio: float, source: Path) -> "Task":
        task = cls(dataset, ratio, source, _identity(source))
        if task.listed is None:  # removed since the folder was listed
            raise BuildError(f"{source}: the partition folder changed while building (the file was removed after "
                             f"being listed): rerun build-shards after preprocess has finished")
        return task

    @property
    def key(self) -> str:
        return f"{self.dataset}--{self.source.stem}"

    def fingerprint(self) -> dict:
        """What the manifest records: the source as listed (not as found after encoding it)."""
        size, mtime_ns = (self.listed or _identity(self.source))[:2]
        return {"file": str(self.source.resolve()), "size": size, "mtime_ns": mtime_ns}

    def check_unchanged(self) -> None:
        """Fail if the source is not the file the build listed (a ``preprocess`` swapped its folder meanwhile)."""
        if self.listed is not None and _identity(self.source) != self.listed:
            raise BuildError(f"{self.source}: the partition folder changed while building (the file was replaced, "
                             f"changed or removed since build-shards listed it): rerun build-shards after "
                             f"preprocess has finished")


def encode_partition_to_shards(task: Task, encoder: DocumentEncoder, output: Path, meta: dict,
                               shard_size: int, dev_fraction: float, seed: int, dev_run: int) -> dict:
    """Encode one partition file into its shards; returns its manifest entry."""
    seq_len, bos, eos = meta["max_seq_len"], meta["special_tokens"]["bos"], meta["special_tokens"]["eos"]
    block = seq_len - 2
    task.check_unchanged()  # before its old shards are deleted
    rng = np.random.default_rng([seed, zlib.crc32(task.key.encode())])
    run_rng = np.random.default_rng([seed, zlib.crc32(task.key.encode()), 1])  # one draw per run of dev_run
    run_is_dev: List[bool] = []
    run_tokens = dev_run * DEV_RUN_UNIT
    for old in _shard_files(output, task.key):  # from an interrupted or outdated run of this file
        old.unlink()
    shards: Dict[str, List[str]] = {"train": [], "dev": []}
    rows: Dict[str, List[np.ndarray]] = {"train": [], "dev": []}
    stats = {"documents": 0, "tokens": 0, "sequences": 0, "sequences_sampled_out": 0, "tokens_dropped_tail": 0,
             "sequences_across_splits": 0, "train_sequences": 0, "dev_sequences": 0}

    def flush(split: str, final: bool = False) -> None:
        while rows[split] and (final or sum(len(r) for r in rows[split]) >= shard_size):
            stacked = np.concatenate(rows[split])
            name = f"{task.key}-{split}-{len(shards[split]):05d}.npy"
            _write_meta_once(output, meta)
            write_shard(output / name, stacked[:shard_size], meta)
            shards[split].append(name)
            rows[split] = [stacked[shard_size:]] if len(stacked) > shard_size else []

    def emit(stream: np.ndarray) -> np.ndarray:
        count = len(stream) // block
        if count:
            blocks = stream[: count * block].reshape(count, block)
            sequences = np.empty((count, seq_len), dtype=meta["dtype"])
            sequences[:, 0], sequences[:, 1:-1], sequences[:, -1] = bos, blocks, eos
            # (Two draws per sequence, the second unused: the second once decided dev for --dev-run 1. Kept, so
            # that a build keeps the sequences it sampled.)
            keep = rng.random((count, 2))[:, 0] < task.ratio
            to_dev, to_train = _runs_split(stats["sequences"], count, block, run_tokens, run_is_dev,
                                           lambda: bool(run_rng.random() < dev_fraction))
            stats["sequences"] += count
            stats["sequences_sampled_out"] += int((~keep).sum())
            stats["sequences_across_splits"] += int((keep & ~to_dev & ~to_train).sum())
            for split, chosen in (("train", keep & to_train), ("dev", keep & to_dev)):
                if chosen.any():
                    rows[split].append(sequences[chosen])
                    stats[f"{split}_sequences"] += int(chosen.sum())
                    flush(split)
        return stream[count * block:]

    separator = np.array([eos], dtype=np.int64)
    carry = np.empty(0, dtype=np.int64)
    pending: List[np.ndarray] = []
    pending_tokens = 0
    for ids in encoder.encode_partition(task.source):
        # Checked before the cast to the shard dtype, which would wrap 65,541 round to 5 in uint16 unseen.
        if len(ids) and not 0 <= ids.min() <= ids.max() < meta["vocab_size"]:
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            raise BuildError(f"{task.source}: document {stats['documents'] + 1} encodes to token id {bad}, not in "
                             f"[0, {meta['vocab_size']}) (vocab_size = len(tokenizer) of {meta['tokenizer']}): the "
                             f"tokenizer gives ids past its own length")
        if stats["documents"]:
            pending.append(separator)
        pending.append(ids)
        pending_tokens += len(ids) + 1
        stats["documents"] += 1
        stats["tokens"] += len(ids)
        if pending_tokens >= 64 * block:  # cut in bulk: fewer, larger numpy operations
            carry = emit(np.concatenate([carry, *pending]))
            pending, pending_tokens = [], 0
    carry = emit(np.concatenate([carry, *pending]))
    stats["tokens_dropped_tail"] = len(carry)
    flush("train", final=True)
    flush("dev", final=True)
    # The file read may have been swapped out while it was read (the open handle keeps the old one): no entry then,
    # so the next run encodes the file in place.
    task.check_unchanged()
    return {"dataset": task.dataset, "source": task.fingerprint(), "ratio": task.ratio, "shards": shards,
            "shard_rows": {split: [np.load(output / n, mmap_mode="r").shape[0] for n in names]
                           for split, names in shards.items()},
            "stats": stats}


def _shard_files(output: Path, key: str) -> List[Path]:
    """The shards ``<key>-<split>-<k>.npy`` of one partition file in ``output``, and their temporaries (left by a
    hard kill mid-write), matched exactly: as a glob pattern the key of a folder named ``books[12]`` would match
    the shards of ``books1``, and ``wiki--part-1`` those of ``wiki--part-1-b``."""
    shard = rf"{re.escape(key)}-(?:train|dev)-[0-9]+\.npy"
    own = re.compile(rf"{shard}|\.{shard}\..+\.tmp")
    if not output.is_dir():  # a new build's folder is made with its first file
        return []
    with os.scandir(output) as entries:
        return [output / e.name for e in entries if own.fullmatch(e.name) and e.is_file(follow_symlinks=False)]


def _runs_split(first: int, count: int, block: int, run_tokens: int, run_is_dev: List[bool],
                draw: Callable[[], bool]) -> tuple:
    """(to_dev, to_train) for the file's sequences ``first`` .. ``first + count - 1``, each ``block`` tokens of its
    token stream: dev if every run of ``run_tokens`` tokens it overlaps is a dev run, train if none is (neither
    if mixed). ``run_is_dev`` holds the runs' draws so far and is extended with ``draw()`` in run order."""
    start = (first + np.arange(count, dtype=np.int64)) * block
    first_run, last_run = start // run_tokens, (start + block - 1) // run_tokens
    while len(run_is_dev) <= last_run[-1]:
        run_is_dev.append(draw())
    lo = int(first_run[0])
    dev_runs_before = np.concatenate([[0], np.cumsum(run_is_dev[lo:int(last_run[-1]) + 1])])  # from run lo
    dev_runs = dev_runs_before[last_run - lo + 1] - dev_runs_before[first_run - lo]
    return dev_runs == last_run - first_run + 1, dev_runs == 0


# Worker processes (spawned, so no Rust thread pool is inherited across a fork) each load the tokenizer once.
_worker: dict = {}


def _init_worker(tokenizer_path: str, output: str, meta: dict, options: dict) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"  # one process per core already; no oversubscription
    _worker.update(encoder=DocumentEncoder(load_tokenizer(tokenizer_path)), output=Path(output), meta=meta,
                   options=options)


def _run_in_worker(task: Task) -> tuple:
    return task, encode_partition_to_shards(task, _worker["encoder"], _worker["output"], _worker["meta"],
                                            **_worker["options"])


def _write_json_if_changed(path: Path, obj) -> bool:
    if path.is_file():
        try:
            if json.loads(path.read_text()) == json.loads(json.dumps(obj)):
                return False
        except json.JSONDecodeError:
            pass
    atomic.write_json(path, obj)
    return True


def tokenizer_identity(tokenizer) -> str:
    """What meta.json records: a tokenizer folder's absolute path, or the Hugging Face name as given."""
    path = Path(tokenizer)
    return os.path.abspath(path) if path.is_dir() else str(tokenizer)


def same_tokenizer(recorded: str, tokenizer, output: Path) -> bool:
    """Whether the tokenizer recorded in ``output``'s meta.json is ``tokenizer``, however either is spelled:
    the same folder (``tok``, ``tok/``, ``./x/../tok``, absolute) or folders with the same tokenizer files."""
    if recorded in (str(tokenizer), tokenizer_identity(tokenizer)):
        return True
    new = Path(tokenizer)
    if not new.is_dir():
        return False
    # Older builds recorded the path as typed: relative to the data folder, or to where the build ran.
    for candidate in (Path(output) / recorded, Path(recorded)):
        if candidate.is_dir() and (candidate.resolve() == new.resolve()
                                   or tokenizer_files_digest(candidate) == tokenizer_files_digest(new)):
            return True
    return False


def dev_split_warning(train: int, dev: int, across: int, dev_fraction: float, dev_run: int,
                      seq_len: int) -> Optional[str]:
    """Whole runs of ``dev_run`` × DEV_RUN_UNIT tokens go to dev: a build with few runs can miss the fraction badly
    (or get no dev sequence at all, and pretraining no dev evaluation), and runs not much longer than a sequence
    leave many sequences across a dev/train boundary, in neither split. Names the run length to use, if any."""
    kept = train + dev
    total = kept + across
    if not total or not dev_fraction:
        return None
    units = total * (seq_len - 2) // DEV_RUN_UNIT  # runs at --dev-run 1 in the build's text
    # The run length to use (a power of two): runs of at least ~4 sequences, else many sequences straddle a dev/train
    # boundary; and as short as that allows, down to ~200 runs, for a fraction within a few percent.
    shortest = 1 << (-(-4 * (seq_len - 2) // DEV_RUN_UNIT) - 1).bit_length()
    longest = 1 << max(0, (units // 200).bit_length() - 1)
    best = min(max(dev_run, shortest), max(longest, shortest))
    far = not kept or abs(dev / kept - dev_fraction) > dev_fraction / 2
    lost = across > total / 20
    if not (far or lost):
        return None
    problems = []
    if far:
        problems.append(f"the dev split holds {dev} of {kept} sequences ({dev / max(kept, 1):.1%}), not "
                        f"~{dev_fraction:.0%}")
    if lost:
        problems.append(f"{across} of {total} sequences ({across / total:.0%}) lie across a boundary between a dev "
                        f"and a train run, in neither split")
    what = (f"{' and '.join(problems)}: it takes whole runs of --dev-run {dev_run} × {DEV_RUN_UNIT} tokens of text "
            f"({dev_run} sequence{'s' if dev_run != 1 else ''} of 512; ~{max(1, -(-units // dev_run))} in this "
            f"build)")
    if units // best < 10:
        return (f"{what}; this build has too little text for a dev split at {seq_len} tokens (runs must hold a few "
                f"sequences, --dev-run {shortest} or more, and it holds ~{units // shortest} of those)")
    rough = f" (still only ~{units // best} runs: expect a rough fraction)" if units // best < 200 else ""
    if best == dev_run:
        return f"{what}; a chance deviation{rough}"
    return (f"{what}; for data this size build again with --dev-run {best}{rough} (make: DEV_RUN={best}), into a "
            f"new folder or after deleting this one (a folder keeps the settings it was built with)")


def build_shards(datasets: Sequence[DatasetSpec], output: Path, tokenizer: str, seq_len: int = 512,
                 shard_size: int = SHARD_SIZE, dev_fraction: float = 0.1, seed: int = 0, workers: int = 1,
                 on_partition_done: Optional[Callable[[Task], None]] = None, dev_run: int = DEV_RUN) -> dict:
    """Build (or resume) a shard folder; returns the stats written to ``stats.json``."""
    _check_options(datasets, seq_len, shard_size, dev_fraction, dev_run, seed, workers)
    output = Path(output)
    # shards in a partition folder would overwrite its stats.json and be read as partitions
    atomic.check_output_folder(output, inputs=[d.folder for d in datasets], error=BuildError)
    # Check every input before writing anything: a failed command must not leave a meta.json behind.
    tasks = [Task.from_listing(d.name, d.ratio, path) for d in datasets for path in partition_files(d.folder)]
    tok = load_tokenizer(tokenizer)
    digest = tokenizer_files_digest(Path(tokenizer)) if Path(tokenizer).is_dir() else None
    meta = make_meta(seq_len, len(tok), tokenizer_identity(tokenizer), special_token_ids(tok),
                     datasets={d.name: d.ratio for d in datasets}, dev_fraction=dev_fraction, dev_run=dev_run,
                     dev_run_unit=DEV_RUN_UNIT, special_token_text="as text", seed=seed, shard_size=shard_size,
                     **({"tokenizer_files_sha256": digest,
                         # also from the data folder: the same layout mounted elsewhere (docker's /workspace)
                         "tokenizer_relative": os.path.relpath(os.path.abspath(tokenizer), os.path.abspath(output))}
                        if digest else {}))
    _check_existing_meta(output, meta, tokenizer)
    for stale in output.glob(".meta.json.*.tmp"):  # a worker's, stopped mid-write when another worker's file failed
        stale.unlink()

    pending = [t for t in tasks if not _finished(output, t)]
    log.info("%d of %d partition files to encode (%d already done)", len(pending), len(tasks),
             len(tasks) - len(pending))
    options = dict(shard_size=shard_size, dev_fraction=dev_fraction, seed=seed, dev_run=dev_run)

    def record(task: Task, entry: dict) -> None:
        _write_meta_once(output, meta)  # (for a partition too short for a shard: its entry says it is finished)
        _manifest_path(output, task).parent.mkdir(exist_ok=True)
        atomic.write_json(_manifest_path(output, task), entry)  # written after the shards: its presence means done
        if on_partition_done is not None:
            on_partition_done(task)

    progress = tqdm(total=len(pending), desc=f"build-shards {seq_len}", unit=" partitions")
    try:
        if pending and workers > 1:
            context = multiprocessing.get_context("spawn")
            with context.Pool(min(workers, len(pending)), _init_worker,
                              (str(tokenizer), str(output), meta, options)) as pool:
                for task, entry in pool.imap_unordered(_run_in_worker, pending):
                    record(task, entry)
                    progress.update()
        elif pending:
            encoder = DocumentEncoder(tok)
            for task in pending:
                record(task, encode_partition_to_shards(task, encoder, output, meta, **options))
                progress.update()
    except UserError as e:
        if (output / "meta.json").is_file():  # files finished before the failure (or beside it) are kept
            e.args = (f"{e.args[0] if e.args else e}; {output} keeps the partition files finished so far and the "
                      "settings they were built with: after the fix the same command resumes, other settings need "
                      "another --output or that folder deleted",) + e.args[1:]
        raise
    finally:
        progress.close()

    _check_inputs_unchanged(datasets, tasks)
    _write_meta_once(output, meta)
    # The split indexes and stats come from the manifest, in input order (not completion order).
    entries = [json.loads(_manifest_path(output, t).read_text()) for t in tasks]
    _write_split_indexes(output, entries)
    stats = _summarise(datasets, entries, seq_len, dev_fraction, dev_run)
    _write_json_if_changed(output / "stats.json", stats)
    log.info("%s: %d train and %d dev sequences of %d tokens", output, stats["train_sequences"],
             stats["dev_sequences"], seq_len)
    return stats


def _check_options(datasets: Sequence[DatasetSpec], seq_len: int, shard_size: int, dev_fraction: float,
                   dev_run: int, seed: int, workers: int) -> None:
    if not 0 <= seed < 2 ** 63:
        raise BuildError(f"--seed must be in [0, 2^63), got {seed}")
    if workers < 1:
        raise BuildError(f"--workers must be at least 1, got {workers}")
    if dev_run < 1:
        raise BuildError(f"--dev-run must be at least 1 (runs of that many × {DEV_RUN_UNIT} tokens), got {dev_run}")
    if seq_len < 3:
        raise BuildError(f"--seq-len must be at least 3 (<s>, one token, </s>), got {seq_len}")
    if not 0 <= dev_fraction < 1:
        raise BuildError(f"--dev-fraction must be in [0, 1), got {dev_fraction}")
    if shard_size < 1:
        raise BuildError(f"--shard-size must be at least 1, got {shard_size}")
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        raise BuildError(f"two inputs share a folder name ({names}); the folder name is the dataset name")


def _check_existing_meta(output: Path, meta: dict, tokenizer: str) -> None:
    """A folder holding a meta.json must have been built with the same settings (a new one gets its meta.json with
    its first file: ``_write_meta_once``)."""
    existing = output / "meta.json"
    if existing.is_file():
        try:
            old = json.loads(existing.read_text())
        except json.JSONDecodeError as e:
            raise BuildError(f"{existing}: not valid JSON ({e}); delete the folder and build again") from None
        new = json.loads(json.dumps(meta))
        old.setdefault("dev_run", 1)  # built before the option: split per sequence
        # Built before runs were measured in tokens: runs of dev_run of its own sequences (the same split as now
        # at seq_len 512, where a sequence holds 510 tokens), or per sequence with another draw (dev_run 1).
        old.setdefault("dev_run_unit", old.get("max_seq_len", 2) - 2 if old["dev_run"] > 1 else "per sequence")
        # Built before corpus text spelling a special token was encoded as text (DocumentEncoder): as the id.
        old.setdefault("special_token_text", "as the special id")
        identity = ("tokenizer", "tokenizer_files_sha256", "tokenizer_relative")
        changed = [f"{k}: {json.dumps(old.get(k))} there, {json.dumps(new.get(k))} now"
                   for k in sorted(set(old) | set(new)) if k not in identity and old.get(k) != new.get(k)]
        if not same_tokenizer(str(old.get("tokenizer")), tokenizer, output):
            changed.append(f"tokenizer: {old.get('tokenizer')} there, {meta['tokenizer']} now")
        elif "tokenizer_files_sha256" in old and old["tokenizer_files_sha256"] != new.get("tokenizer_files_sha256"):
            # the same folder, other files (e.g. train-tokenizer --overwrite): its shards hold the old ids
            changed.append(f"the files of tokenizer {meta['tokenizer']} changed since its shards were encoded")
        if changed:
            raise BuildError(f"{existing}: this folder was built with other settings ({'; '.join(changed)}); "
                             f"build into a new folder or delete it")


def _write_meta_once(output: Path, meta: dict) -> None:
    """A new folder's meta.json is written with its first file (a shard or a manifest entry), not before: a build
    that fails before that (a partition that is not UTF-8) leaves no folder that refuses the corrected command's
    settings. Then it stays as written: a later run with other settings is refused (``_check_existing_meta``)."""
    if not (output / "meta.json").is_file():
        output.mkdir(parents=True, exist_ok=True)
        write_meta(output, meta)


def _manifest_path(output: Path, task: Task) -> Path:
    return output / MANIFEST_DIR / f"{task.key}.json"


def _finished(output: Path, task: Task) -> bool:
    """Whether the partition file's manifest entry exists, matches the file and its shards all exist (one deleted
    by hand, or by an older build that matched the names of another folder's shards, is redone, not a crash when
    the indexes are written)."""
    path = _manifest_path(output, task)
    if not path.is_file():
        return False
    entry = json.loads(path.read_text())
    if entry["source"] != task.fingerprint():
        return False
    missing = [name for names in entry["shards"].values() for name in names if not (output / name).is_file()]
    if missing:
        log.warning("%s lists %d shard(s) that do not exist (e.g. %s): encoding %s again", path, len(missing),
                    missing[0], task.source)
        return False
    return True


def _check_inputs_unchanged(datasets: Sequence[DatasetSpec], tasks: List[Task]) -> None:
    # The indexes must describe the folders as they are: a swap after a file was encoded (or skipped) is an error.
    for d in datasets:
        listed = [t.source for t in tasks if t.dataset == d.name]
        if partition_files(d.folder) != listed:
            raise BuildError(f"{d.folder}: the partition folder changed while building (its partition files are "
                             f"not those listed at the start): rerun build-shards after preprocess has finished")
    for task in tasks:
        task.check_unchanged()


def _write_split_indexes(output: Path, entries: List[dict]) -> None:
    for split in ("train", "dev"):
        files = [name for e in entries for name in e["shards"][split]]
        rows = [r for e in entries for r in e["shard_rows"][split]]
        expected = {"num_sequences": sum(rows),
                    "shards": [{"file": f, "num_sequences": r} for f, r in zip(files, rows)]}
        index = output / f"{split}.json"
        if not index.is_file() or json.loads(index.read_text()) != expected:
            write_split_index(output, split, files)


def _summarise(datasets: Sequence[DatasetSpec], entries: List[dict], seq_len: int, dev_fraction: float,
               dev_run: int) -> dict:
    """stats.json: per-dataset totals of the manifest entries, overall counts, and warnings."""
    stats: dict = {"seq_len": seq_len, "datasets": {}}
    for d in datasets:
        totals: Dict[str, int] = {}
        for e in entries:
            if e["dataset"] == d.name:
                for k, v in e["stats"].items():
                    totals[k] = totals.get(k, 0) + v
        stats["datasets"][d.name] = {"folder": str(d.folder), "sampling_ratio": d.ratio,
                                     "partition_files": sum(e["dataset"] == d.name for e in entries), **totals}
    # A dataset that adds nothing is named, not silently missing from the mixture.
    stats["warnings"] = []
    for name, d in stats["datasets"].items():
        if d.get("train_sequences", 0) + d.get("dev_sequences", 0) == 0:
            if d.get("sequences", 0):
                why = f"all {d['sequences']} of its sequences were sampled out at ratio {d['sampling_ratio']}"
            else:
                why = (f"no partition file of it holds enough tokens for one sequence of {seq_len} "
                       f"({d.get('tokens', 0)} tokens in {d['partition_files']} file(s))")
            stats["warnings"].append(f"dataset {name} ({d['folder']}) contributes no sequences: {why}")
            log.warning("%s", stats["warnings"][-1])
    stats["train_sequences"] = sum(s.get("train_sequences", 0) for s in stats["datasets"].values())
    stats["dev_sequences"] = sum(s.get("dev_sequences", 0) for s in stats["datasets"].values())
    across = sum(s.get("sequences_across_splits", 0) for s in stats["datasets"].values())
    split_warning = dev_split_warning(stats["train_sequences"], stats["dev_sequences"], across, dev_fraction,
                                      dev_run, seq_len)
    if split_warning:
        stats["warnings"].append(split_warning)
        log.warning("%s", split_warning)
    return stats
