"""JSON-lines logs (one object per line), as the paper's pretrain_output.log and validation_output.log.

Lines are appended, so a hard kill or a full disk can leave a torn last line: readers skip lines that do not
parse (and say so) instead of refusing to resume or plot.
"""
from __future__ import annotations

import json
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

    def truncate_after(self, step: int) -> None:
        if not self.enabled or not self.path.is_file():
            return
        kept = [e for e in read(self.path) if e.get("step", 0) <= step]
        atomic.write_text(self.path, "".join(json.dumps(e) + "\n" for e in kept))

    def write(self, **entry) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")
