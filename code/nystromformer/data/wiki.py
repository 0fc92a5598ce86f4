"""Wikipedia extraction with the real ``wikiextractor`` package, run as a subprocess.

A subprocess because WikiExtractor keeps module-level state (templates, options) and starts its own worker
processes; running it in-process would leak that state into ours. Pinned to wikiextractor 3.1.0: 3.0.6 (the last
upstream release before it) dies on Python >= 3.11 with ``re.error: global flags not at the start of the
expression`` while compiling its patterns.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

log = logging.getLogger("nystromformer.data")
MAX_PROCESSES = 256
MIN_FILE_BYTES = 200 * 1024  # wikiextractor's own minimum (below it, it logs an error and exits 0)


def _file_size(text: str) -> Optional[int]:
    """wikiextractor's --bytes as it parses it (digits and a K/M/G suffix, or "0"), None if it would reject it."""
    if text == "0":
        return 0
    match = re.fullmatch(r"([0-9]+)([KkMmGg])", text)
    return int(match[1]) * 1024 ** ("kmg".index(match[2].lower()) + 1) if match else None


def extract_wiki_command(dump: Path, output: Path, processes: int, bytes_per_file: str = "100M") -> List[str]:
    return [sys.executable, "-m", "wikiextractor.WikiExtractor", str(dump), "--output", str(output),
            "--processes", str(processes), "--bytes", bytes_per_file]


def extract_wiki(dump: Path, output: Path, processes: int = min(os.cpu_count() or 1, MAX_PROCESSES),
                 bytes_per_file: str = "100M", overwrite: bool = False) -> int:
    """Extract ``<doc>`` files from a pages-articles dump into ``output/AA/wiki_00``, ...; returns the exit code.
    wikiextractor writes over same-named files and leaves the rest, so an earlier extraction's ``wiki_*`` files in
    ``output`` are an error (``preprocess`` would read old and new articles alike) unless ``overwrite`` deletes
    them first."""
    from .partitions import InputError
    dump, output = Path(dump), Path(output)
    if not dump.is_file():
        raise InputError(f"{dump}: wiki dump not found (download enwiki-latest-pages-articles.xml.bz2)")
    # wikiextractor itself hangs with no worker process and exits 0 after rejecting a size.
    if not 1 <= processes <= MAX_PROCESSES:
        raise InputError(f"--processes: must be from 1 to {MAX_PROCESSES}, got {processes}")
    size = _file_size(bytes_per_file)
    if size is None or 0 < size < MIN_FILE_BYTES:
        raise InputError(f"--bytes: a size of at least 200K with a K, M or G suffix (e.g. 100M, 1G), or 0 for one "
                         f"article per file; got {bytes_per_file!r}")
    if dump.suffix == ".bz2":  # wikiextractor would fail with a traceback from its reader thread
        with open(dump, "rb") as f:
            head = f.read(3)
        if head != b"BZh":
            raise InputError(f"{dump}: not bzip2 data (a .bz2 file begins with 'BZh', this one with {head!r}): an "
                             f"incomplete download, or a web page saved under the dump's name?")
    earlier = sorted(f for f in output.rglob("wiki_*") if f.is_file()) if output.is_dir() else []
    if earlier and not overwrite:
        raise InputError(f"--output {output}: holds {len(earlier)} wiki_* file(s) of an earlier extraction (e.g. "
                         f"{earlier[0].relative_to(output)}), which preprocess would read beside the new ones; "
                         f"extract into a new folder, or add --overwrite to delete them first")
    for f in earlier:
        f.unlink()
    for folder in sorted({f.parent for f in earlier}, reverse=True):  # wikiextractor's AA, AB, …, if now empty
        if folder != output and not any(folder.iterdir()):
            folder.rmdir()
    output.mkdir(parents=True, exist_ok=True)
    command = extract_wiki_command(dump, output, processes, bytes_per_file)
    log.info("running %s", " ".join(command))
    result = subprocess.run(command)
    if result.returncode != 0:
        log.error("wikiextractor failed on %s with exit code %d (its message is above; a damaged or truncated "
                  "download? `bzip2 -t %s` checks a .bz2 file)", dump, result.returncode, dump)
        return result.returncode
    if not any(_starts_with_article(f) for f in output.rglob("wiki_*") if f.is_file()):
        raise InputError(f"{dump}: wikiextractor found no article in it (is it a pages-articles XML dump?)")
    return 0


def _starts_with_article(path: Path) -> bool:
    with open(path, "rb") as f:  # an output file opens with its first <doc ...> line (files are up to 100M)
        return f.read(64 * 1024).lstrip().startswith(b"<doc ")
