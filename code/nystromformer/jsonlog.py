"""JSON-lines logs (one object per line), as the paper's pretrain_output.log and validation_output.log.

Lines are appended, so a hard kill or a full disk can leave a torn last line: readers skip lines that do not
parse (and say so) instead of refusing to resume or plot.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Union

from . import atomic


def read(path: Union[str, Path]) -> List[dict]:
    entries, torn = [], []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            entry = None
        if isinstance(entry, dict):  # every line this project writes is an object
            entries.append(entry)
        else:
            torn.append(number)
    if torn:
        where = ", ".join(map(str, torn[:5])) + (", ..." if len(torn) > 5 else "")
        print(f"warning: {path}: skipped {len(torn)} unreadable line(s) (line {where}: a torn write?)",
              file=sys.stderr)
    return entries


class JsonLog:
    """Appends entries; on resume, entries past the checkpoint's step are dropped so the log reads as one
    uninterrupted run."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self._tail_checked = False

    def truncate_after(self, step: int) -> None:
        if not self.enabled or not self.path.is_file():
            return
        kept = [e for e in read(self.path) if e.get("step", 0) <= step]
        atomic.write_text(self.path, "".join(json.dumps(e) + "\n" for e in kept))

    def write(self, **entry) -> None:
        if self.enabled:
            if not self._tail_checked:
                self._remove_torn_tail()
                self._tail_checked = True
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def _remove_torn_tail(self) -> None:
        """An earlier process killed mid-write left a last line without its newline: appended to, it would glue
        the next entry onto the fragment and lose both. A fragment that is not an entry is cut and named; a whole
        entry that only lacks its newline (killed between the two, or written by another tool) gets it."""
        if not self.path.is_file():
            return
        with open(self.path, "r+b") as f:
            size = f.seek(0, 2)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            f.seek(0)
            data = f.read()
            keep = data.rfind(b"\n") + 1
            whole = _is_entry(data[keep:])
            if whole:
                f.write(b"\n")
            else:
                f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        if whole:
            return
        fragment = data[keep:keep + 60].decode("utf-8", "replace")
        print(f"warning: {self.path}: removed a torn last line ({len(data) - keep} bytes: {fragment!r}...), left "
              f"by a process stopped while writing it", file=sys.stderr)


def _is_entry(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # (JSONDecodeError and UnicodeDecodeError)
        return False
