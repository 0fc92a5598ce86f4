"""Unified partitions: plain-text files of ~N words, documents separated by one blank line.

This is the format the paper's scripts wrote (~20M words per partition) and the input of both
``train-tokenizer`` and ``build-shards``. A folder holds ``part-00000.txt``, ``part-00001.txt``, ... and
``stats.json`` (what was read, kept, dropped and skipped, and the names and sizes of the partitions).

A folder is replaced as a whole: ``preprocess`` writes into a hidden sibling folder and swaps it in at the end
(two renames), so one listing of the folder names the files of the old folder or all of the new one. A reader that
lists the folder once and opens the files later by path can still get files of a folder swapped in meanwhile (a
file it already holds open stays the old one): such a reader must check that the files did not change while it
worked, as ``build-shards`` does (size, mtime and inode). A run killed between the two renames leaves no folder at
``output``; the next run first restores one (see ``_recover_leftovers``). A symlinked output is swapped at the link's
target; an output that is a mount point cannot be renamed and is refused. A partition whose content did not change
keeps its modification time (``build-shards`` resumes on size and mtime), and a re-run with the same inputs
(paths, sizes, mtimes) and settings as the folder's ``stats.json`` records does nothing.
"""
from __future__ import annotations

import filecmp
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence

from tqdm import tqdm

from .. import atomic
from ..errors import UserError, first_undecodable_line
from .readers import SkipLog

log = logging.getLogger("nystromformer.data")
# What the readers make of the same input; a folder written by another version is not up to date, so a rerun redoes
# it. 2 (2026-11-23): wiki text HTML-unescaped and transclusion tags dropped; a file's byte-order mark dropped.
READER_VERSION = 2

PARTITION_GLOB = "part-*.txt"
PARTITION_NAME = re.compile(r"part-\d{5,}\.txt")
WORDS_PER_PARTITION = 20_000_000


class PartitionError(UserError, ValueError):
    """A partition folder that cannot be used or replaced; the message names the folder."""


class InputError(UserError, FileNotFoundError):
    """A path the user named does not exist or holds nothing usable (a FileNotFoundError the CLI reports in one
    line; any other FileNotFoundError is a bug and keeps its traceback)."""


def partition_name(index: int) -> str:
    return f"part-{index:05d}.txt"


def partition_files(folder: Path) -> List[Path]:
    """The folder's partition files, sorted; checked against the names and sizes its stats.json records."""
    folder = Path(folder)
    files = sorted(folder.glob(PARTITION_GLOB))
    if not files:
        raise InputError(f"{folder}: no partition files ({PARTITION_GLOB}); "
                                f"create them with `nystromformer preprocess`")
    stats_path = folder / "stats.json"
    if stats_path.is_file():  # folders written by other tools may have none
        try:
            stats = json.loads(stats_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PartitionError(f"{stats_path}: not valid JSON ({e}); run `nystromformer preprocess` again") from None
        if not isinstance(stats, dict):
            raise PartitionError(f"{stats_path}: not a preprocess stats file (a JSON object); run `nystromformer "
                                 f"preprocess` again")
        recorded = stats.get("partitions")
        sizes = stats.get("partition_bytes")
        found = [p.name for p in files]
        problem = None
        if recorded is not None and recorded != found:
            problem = f"it lists {len(recorded)} partition(s), the folder holds {len(found)}"
            if set(recorded) != set(found):
                extra, missing = sorted(set(found) - set(recorded)), sorted(set(recorded) - set(found))
                problem += f" (unlisted: {', '.join(extra) or 'none'}; missing: {', '.join(missing) or 'none'})"
        elif sizes is not None:
            for path, size in zip(files, sizes):
                if path.stat().st_size != size:
                    problem = f"{path.name} has {path.stat().st_size} bytes, stats.json says {size}"
                    break
        if problem:
            raise PartitionError(f"{folder}: partition files do not match its stats.json: {problem}; the folder was "
                                 f"changed after `nystromformer preprocess` wrote it: run preprocess again")
    return files


def input_fingerprints(inputs: Optional[Sequence[str]]) -> List[dict]:
    """Absolute path, size and mtime of each input file: what decides whether a folder is up to date."""
    out = []
    for name in inputs or []:
        stat = os.stat(name)
        out.append({"file": os.path.abspath(name), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return out


def _up_to_date(output: Path, settings: dict) -> Optional[dict]:
    """The folder's stats when it was written from exactly these inputs and settings and is intact, else None."""
    path = output / "stats.json"
    if not settings["input_files"] or not path.is_file():
        return None
    try:
        stats = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    # Inputs are compared by absolute path, size and mtime ("inputs" is only how they were spelled).
    wanted = {k: v for k, v in json.loads(json.dumps(settings)).items() if k != "inputs"}
    if any(stats.get(key) != value for key, value in wanted.items()):
        return None
    try:
        partition_files(output)
    except (FileNotFoundError, PartitionError):
        return None
    return stats


def _check_replaceable(output: Path) -> None:
    """Refuse to replace a folder holding anything but partitions (the swap would delete it)."""
    if output.exists() and not output.is_dir():
        raise PartitionError(f"{output}: exists and is not a folder")
    if not output.is_dir():
        return
    foreign = sorted(p.name for p in output.iterdir()
                     if not (PARTITION_NAME.fullmatch(p.name) or p.name == "stats.json"
                             or (p.name.startswith(".") and p.name.endswith(".tmp"))))  # atomic.py's temporaries
    if foreign:
        raise PartitionError(f"{output}: holds files preprocess did not write ({', '.join(foreign[:5])}"
                             f"{', ...' if len(foreign) > 5 else ''}); preprocess replaces the whole folder, "
                             f"so give it an empty or new --output folder")


def _file_system(path: Path) -> int:
    """The device id of the file system holding ``path``."""
    return os.stat(path).st_dev


def _check_renamable(output: Path) -> None:
    """Refuse an output folder that is a mount point (a Docker bind mount, say) or on another file system than its
    parent: the swap renames it aside and a sibling work folder into its place, which fails there (EBUSY, EXDEV)
    only after all the work, and the work folder would sit on the parent's file system."""
    if output.is_dir() and (os.path.ismount(output) or _file_system(output) != _file_system(output.parent)):
        raise PartitionError(f"{output}: is a mount point (or on another file system than its parent folder); "
                             f"preprocess replaces its output folder by renaming, which cannot be done there: "
                             f"give a folder inside it as --output, e.g. {output / output.name}")


def _complete(folder: Path) -> bool:
    """Whether a work folder was finished: its stats.json (written last) exists and matches its partitions."""
    try:
        stats = json.loads((folder / "stats.json").read_text())
        if not isinstance(stats, dict) or not isinstance(stats.get("partitions"), list):
            return False
        if not stats["partitions"]:  # no document kept: a complete folder holds stats.json alone
            return not any(folder.glob(PARTITION_GLOB))
        partition_files(folder)
        return True
    except (OSError, ValueError):  # missing or unreadable stats.json, bad JSON, PartitionError
        return False


def _remove(path: Path) -> None:
    """Best-effort removal: a symlink is unlinked (never its target's content); a folder another process still
    holds files in (NFS keeps ``.nfs*`` files of open ones) stays, with a warning; the next run tries again."""
    if path.is_symlink():
        path.unlink()
        return
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        log.warning("could not remove all of %s (files still open elsewhere?); the next preprocess run of this "
                    "folder removes it", path)


def _recover_leftovers(output: Path) -> None:
    """Deal with sibling work folders left by a killed run (an interrupted one cleans up after itself).

    When ``output`` is missing (killed between the swap's two renames, or before the first swap of a new folder),
    it is restored first: from the folder the killed run had moved aside (``.old``) if it is complete, else from a
    complete work folder (``.partial``); complete: its stats.json matches its partitions. A ``.trash`` folder (an
    old folder being removed after a swap, maybe half gone) is never restored. The other leftovers are then
    removed, except an incomplete ``.old`` while ``output`` is missing: it stays, with a warning, until a run finds
    ``output`` in place."""
    pattern = re.compile(rf"\.{re.escape(output.name)}\.[A-Za-z0-9_]{{8}}\.(partial|old|trash)")
    leftovers = [p for p in output.parent.iterdir() if pattern.fullmatch(p.name) and (p.is_dir() or p.is_symlink())]
    if not os.path.lexists(output):
        # The newest .old (a rename sets its ctime) is the folder that was at output; else the complete .partial.
        olds = sorted((p for p in leftovers if p.name.endswith(".old") and p.is_dir()),
                      key=lambda p: p.lstat().st_ctime_ns, reverse=True)
        # An incomplete .old may be half deleted (left by a version that removed it in place): never restored.
        kept = [p for p in olds if not _complete(p)]
        olds = [p for p in olds if p not in kept]
        partials = [p for p in leftovers if p.name.endswith(".partial") and not p.is_symlink() and _complete(p)]
        for source in olds[:1] or partials[:1]:
            os.rename(source, output)
            atomic.fsync_dir(output.parent)
            log.warning("%s was missing (a preprocess run was killed while swapping it in): restored it from %s",
                        output, source.name)
            leftovers.remove(source)
        for path in kept:
            log.warning("%s is missing and %s, a folder a killed preprocess run had moved aside, is not restored: "
                        "it has no stats.json matching its partitions (it may be half deleted); it stays until a "
                        "preprocess run finds %s in place, which removes it", output, path, output.name)
            leftovers.remove(path)
    for path in leftovers:
        log.info("removing %s (left by a killed preprocess run)", path)
        _remove(path)


def _keep_mtime_if_unchanged(new: Path, old: Path) -> None:
    """Give ``new`` the mtime of ``old`` when their bytes are equal: build-shards then sees it unchanged."""
    if old.is_file() and old.stat().st_size == new.stat().st_size and filecmp.cmp(old, new, shallow=False):
        stat = old.stat()
        os.utime(new, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _default_dir_mode() -> int:
    return 0o777 & ~atomic.current_umask()


def _swap_in(work: Path, output: Path) -> None:
    """Rename ``output`` aside and ``work`` into its place, then remove the old folder.

    An exception between the renames (KeyboardInterrupt, SIGTERM raised as one) puts the old folder back; a kill
    there leaves no ``output`` (an error for readers, never a mix) and the next run restores it."""
    old = work.with_name(work.name[: -len(".partial")] + ".old")
    atomic.swap_folder(work, output, old)
    if os.path.lexists(old):
        # Renamed first: a kill during the removal leaves a half-deleted .trash, which is never restored (a .old is).
        trash = old.with_name(old.name[: -len(".old")] + ".trash")
        try:
            os.rename(old, trash)
        except OSError:
            trash = old
        _remove(trash)  # best effort: the swap is done, a failure here must not fail the run


def write_partitions(documents: Iterable[str], output: Path, dataset: str, skips: SkipLog,
                     words_per_partition: int = WORDS_PER_PARTITION, min_words: int = 0,
                     inputs: Optional[List[str]] = None, reader_options: Optional[dict] = None) -> dict:
    """Stream documents into a new partition folder, swapped in for ``output`` once complete with its
    ``stats.json``. Returns the stats; when ``output`` is already up to date, returns its stats untouched."""
    # Resolved: the swap renames the link's target (renaming a symlink would move the link, not the data), and
    # "parts/wiki/" and "./x/../parts/wiki" name one sibling work folder.
    output = Path(output).resolve()
    if words_per_partition < 1:
        raise PartitionError(f"--words-per-partition must be at least 1, got {words_per_partition}")
    if min_words < 0:
        raise PartitionError(f"--min-words must be at least 0, got {min_words}")
    _check_renamable(output)  # before any input is read: the swap at the end would fail
    if output.parent.is_dir():  # first, so that a restored folder can be up to date
        _recover_leftovers(output)
        output = output.resolve()  # a restored .old may be a symlink (moved by a version that renamed links)
    settings = {"dataset": dataset, "inputs": inputs or [], "input_files": input_fingerprints(inputs),
                "reader_options": reader_options or {}, "reader_version": READER_VERSION, "min_words": min_words,
                "words_per_partition": words_per_partition}
    current = _up_to_date(output, settings)
    if current is not None:
        log.info("%s: up to date (same inputs and settings as its stats.json); nothing to do", output)
        return current
    _check_replaceable(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    os.chmod(work, output.stat().st_mode & 0o7777 if output.is_dir() else _default_dir_mode())  # mkdtemp: 0700
    stats = {**settings, "documents_read": 0, "documents_kept": 0, "documents_too_short": 0, "words": 0,
             "partitions": [], "partition_bytes": []}
    written: List[str] = []
    handle = None  # the open atomic writer of the current partition
    context = None
    words_in_part = 0
    complete = False  # work holds every partition and stats.json

    def close_partition() -> None:
        nonlocal handle, context
        context.__exit__(None, None, None)
        handle = context = None
        _keep_mtime_if_unchanged(work / written[-1], output / written[-1])

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
                context = atomic.atomic_open(work / name, "w")
                handle = context.__enter__()
                written.append(name)
                words_in_part = 0
            handle.write(document + "\n\n")
            words_in_part += words
            stats["documents_kept"] += 1
            stats["words"] += words
            if words_in_part >= words_per_partition:
                close_partition()
        if context is not None:
            close_partition()
        if not written:  # before the swap: a folder of no partitions would replace a good one and feed 0 shards
            raise PartitionError(f"{dataset}: no document kept ({stats['documents_read']} read, "
                                 f"{stats['documents_too_short']} empty or under {min_words} words; "
                                 f"skipped {dict(skips.counts) or 'nothing'}): is the input this dataset's format?")
        stats["partitions"] = written
        stats["partition_bytes"] = [(work / name).stat().st_size for name in written]
        stats["skipped"] = skips.as_dict()
        atomic.write_json(work / "stats.json", stats)
        _keep_mtime_if_unchanged(work / "stats.json", output / "stats.json")
        complete = True
        _swap_in(work, output)
    except BaseException as e:
        if context is not None:
            context.__exit__(type(e), e, e.__traceback__)
        if complete and not os.path.lexists(output):
            # Nothing at output (a new folder, or the old one could not be put back): keep the complete new data
            # for the next run to restore rather than leave no data at all.
            log.warning("%s: interrupted while swapping in; the complete new folder stays in %s and the next run "
                        "restores it", output, work.name)
        else:
            shutil.rmtree(work, ignore_errors=True)  # output holds the old (or already the new) folder
        raise
    log.info("%s: kept %d of %d documents (%d words) in %d partitions; %d too short; skipped %s",
             dataset, stats["documents_kept"], stats["documents_read"], stats["words"], len(written),
             stats["documents_too_short"], dict(skips.counts) or "nothing")
    return stats


def read_partition(path: Path) -> Iterator[str]:
    """Documents of one partition file, streamed (blank lines separate documents)."""
    lines: List[str] = []
    # newline="\n": a lone \r inside a document is text, not a line break (universal newlines would turn
    # "\r\r" into a blank line, i.e. a document boundary).
    try:
        with open(path, encoding="utf-8", newline="\n") as f:
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines).rstrip("\n")
                    lines = []
    except UnicodeDecodeError as e:  # preprocess writes UTF-8: the file was made or changed by hand
        raise PartitionError(f"{path}:{first_undecodable_line(path)}: not UTF-8 ({e.reason}); partition files are "
                             f"written by `nystromformer preprocess`") from None
    if lines:
        yield "".join(lines).rstrip("\n")
