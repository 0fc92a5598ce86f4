"""Test-set predictions in the format the GLUE server accepts: one ``<TASK>.tsv`` per test split with the
header ``index\tprediction``. Label strings where the task has them (entailment, not_entailment, ...),
0/1 for CoLA, SST-2, MRPC, QQP and WNLI, and a score clipped to [0, 5] for STS-B."""
from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from .. import atomic
from .tasks import SCORE_RANGE


def format_predictions(labels: Optional[List[str]], outputs: np.ndarray) -> List[str]:
    """``outputs`` are logits (n, classes) for classification or scores (n,) for regression."""
    if labels is None:
        return [f"{s:.3f}" for s in np.clip(outputs, *SCORE_RANGE)]
    return [labels[i] for i in np.asarray(outputs).argmax(axis=-1)]


def write_submission(path: Path, indices: Sequence[str], predictions: Sequence[str]) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf, delimiter="\t", lineterminator="\n", quoting=csv.QUOTE_NONE)
    writer.writerow(["index", "prediction"])
    writer.writerows(zip(indices, predictions))
    atomic.write_text(path, buf.getvalue())


def read_submission(path: Path) -> List[List[str]]:
    """Rows after the header, as the GLUE server would read them (used by the tests and for checks)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows or rows[0] != ["index", "prediction"]:
        raise ValueError(f"{path}: header must be 'index\\tprediction'")
    return rows[1:]
