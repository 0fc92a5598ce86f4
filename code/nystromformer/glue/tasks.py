"""GLUE tasks: where each task's files are, which columns hold the text and the label, and readers.

The files are the official GLUE TSVs (as written by the usual ``download_glue_data.py``). They are read
with ``csv.QUOTE_NONE`` because GLUE text contains unbalanced quotes that the default dialect would glue
across lines. A row that cannot be used (wrong number of fields, empty text, unknown label) is counted
and reported with its file:line, never silently dropped and never a crash.
"""
from __future__ import annotations

import csv
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import UserError, first_undecodable_line

# Some GLUE fields (MNLI parses) are longer than csv's default 128 KiB limit.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


class GlueDataError(UserError, ValueError):
    """A GLUE file that is missing or unusable as a whole (not a single bad row)."""


class MissingGlueFile(GlueDataError):
    """The file is not there (as opposed to there but unreadable)."""


@dataclass
class Example:
    index: str                  # the row's id in the file (the test index the GLUE server expects)
    text_a: str
    text_b: Optional[str]
    label: Optional[object]     # int class id, float score (STS-B), or None (test splits)


@dataclass
class Columns:
    """Where a file's fields are. Names refer to the header; ints to positions (header-less CoLA)."""
    text_a: object
    text_b: object = None
    label: object = None
    index: object = None        # None: the row's position in the file (0-based, header excluded)
    header: bool = True
    num_fields: Optional[int] = None   # required field count for header-less files


@dataclass
class Task:
    name: str                   # canonical name, as in the GLUE folder and the paper's --task
    folder: str
    labels: Optional[List[str]]         # label strings in class-id order; None for regression
    train: Tuple[str, Columns]
    dev: Dict[str, Tuple[str, Columns]]     # dev split name -> (file, columns); MNLI has two
    test: Dict[str, Tuple[str, Columns]]    # submission file name -> (file, columns)

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def is_regression(self) -> bool:
        return self.labels is None


def _pair(label="label", index="index", a="sentence1", b="sentence2") -> Columns:
    return Columns(text_a=a, text_b=b, label=label, index=index)


def _test_pair(a="sentence1", b="sentence2", index="index") -> Columns:
    return Columns(text_a=a, text_b=b, index=index)


_MNLI_LABELS = ["contradiction", "entailment", "neutral"]
_MNLI_TRAIN = Columns(text_a="sentence1", text_b="sentence2", label="gold_label", index="index")

TASKS: Dict[str, Task] = {t.name: t for t in [
    Task("CoLA", "CoLA", ["0", "1"],
         train=("train.tsv", Columns(text_a=3, label=1, header=False, num_fields=4)),
         dev={"dev": ("dev.tsv", Columns(text_a=3, label=1, header=False, num_fields=4))},
         test={"CoLA.tsv": ("test.tsv", Columns(text_a="sentence", index="index"))}),
    Task("SST-2", "SST-2", ["0", "1"],
         train=("train.tsv", Columns(text_a="sentence", label="label")),
         dev={"dev": ("dev.tsv", Columns(text_a="sentence", label="label"))},
         test={"SST-2.tsv": ("test.tsv", Columns(text_a="sentence", index="index"))}),
    Task("MRPC", "MRPC", ["0", "1"],
         train=("train.tsv", Columns(text_a="#1 String", text_b="#2 String", label="Quality")),
         dev={"dev": ("dev.tsv", Columns(text_a="#1 String", text_b="#2 String", label="Quality"))},
         test={"MRPC.tsv": ("test.tsv", Columns(text_a="#1 String", text_b="#2 String", index="index"))}),
    Task("STS-B", "STS-B", None,
         train=("train.tsv", _pair(label="score")),
         dev={"dev": ("dev.tsv", _pair(label="score"))},
         test={"STS-B.tsv": ("test.tsv", _test_pair())}),
    Task("QQP", "QQP", ["0", "1"],
         train=("train.tsv", _pair(label="is_duplicate", index="id", a="question1", b="question2")),
         dev={"dev": ("dev.tsv", _pair(label="is_duplicate", index="id", a="question1", b="question2"))},
         test={"QQP.tsv": ("test.tsv", _test_pair(a="question1", b="question2", index="id"))}),
    Task("MNLI", "MNLI", _MNLI_LABELS,
         train=("train.tsv", _MNLI_TRAIN),
         dev={"matched": ("dev_matched.tsv", _MNLI_TRAIN), "mismatched": ("dev_mismatched.tsv", _MNLI_TRAIN)},
         test={"MNLI-m.tsv": ("test_matched.tsv", _test_pair()),
               "MNLI-mm.tsv": ("test_mismatched.tsv", _test_pair())}),
    Task("QNLI", "QNLI", ["entailment", "not_entailment"],
         train=("train.tsv", _pair(a="question", b="sentence")),
         dev={"dev": ("dev.tsv", _pair(a="question", b="sentence"))},
         test={"QNLI.tsv": ("test.tsv", _test_pair(a="question", b="sentence"))}),
    Task("RTE", "RTE", ["entailment", "not_entailment"],
         train=("train.tsv", _pair()), dev={"dev": ("dev.tsv", _pair())},
         test={"RTE.tsv": ("test.tsv", _test_pair())}),
    Task("WNLI", "WNLI", ["0", "1"],
         train=("train.tsv", _pair()), dev={"dev": ("dev.tsv", _pair())},
         test={"WNLI.tsv": ("test.tsv", _test_pair())}),
]}

SCORE_RANGE = (0.0, 5.0)  # STS-B, GLUE's one regression task: similarity from 0 to 5
# The diagnostic set: test-only, three NLI classes, predicted with the MNLI model.
AX_FILES = ("diagnostic/diagnostic.tsv", "AX/AX.tsv", "AX/test.tsv")
AX_COLUMNS = _test_pair()

_ALIASES = {name.lower().replace("-", ""): name for name in TASKS}


def get_task(name: str) -> Task:
    """Look a task up by name, forgiving case and the dash (``sst2``, ``STS-B``, ``mnli`` all work)."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in _ALIASES:
        raise GlueDataError(f"unknown GLUE task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[_ALIASES[key]]


@dataclass
class ReadResult:
    examples: List[Example]
    path: Path
    malformed: List[str] = field(default_factory=list)   # "file:line: reason" for every skipped row

    def report(self, shown: int = 3) -> Optional[str]:
        """One line naming the first few malformed rows, or None when every row was usable."""
        if not self.malformed:
            return None
        first = "; ".join(self.malformed[:shown])
        more = f" (and {len(self.malformed) - shown} more)" if len(self.malformed) > shown else ""
        return f"{self.path}: skipped {len(self.malformed)} malformed row(s): {first}{more}"


def _field_index(spec, header: Optional[List[str]], path: Path) -> Optional[int]:
    if spec is None or isinstance(spec, int):
        return spec
    if spec not in header:
        raise GlueDataError(f"{path}: no column {spec!r} in the header ({', '.join(header)}); "
                            f"is this the official GLUE file?")
    return header.index(spec)


def read_tsv(path: Path, columns: Columns, labels: Optional[List[str]], with_labels: bool = True) -> ReadResult:
    """Read one GLUE file. ``labels`` maps label strings to ids; None means float scores (STS-B)."""
    path = Path(path)
    if not path.is_file():
        raise MissingGlueFile(f"missing GLUE file {path}")
    try:
        return _read_tsv(path, columns, labels, with_labels)
    except UnicodeDecodeError as e:
        raise GlueDataError(f"{path}:{first_undecodable_line(path)}: not UTF-8 ({e.reason})") from None
    except (OSError, csv.Error) as e:  # unreadable as a whole: a user error naming the file
        raise GlueDataError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _read_tsv(path: Path, columns: Columns, labels: Optional[List[str]], with_labels: bool) -> ReadResult:
    label_ids = {s: i for i, s in enumerate(labels)} if labels is not None else None
    result = ReadResult([], path)
    with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: some GLUE files start with a BOM
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = None
        if columns.header:
            header = next(reader, None)
            if header is None:
                raise GlueDataError(f"{path}: empty file (expected a header line)")
        num_fields = len(header) if header is not None else columns.num_fields
        a, b = _field_index(columns.text_a, header, path), _field_index(columns.text_b, header, path)
        lab = _field_index(columns.label, header, path) if with_labels else None
        idx = _field_index(columns.index, header, path)
        row_number = -1  # the row's position among the file's rows, malformed ones included
        first_seen: Dict[str, int] = {}  # index -> line
        for row in reader:
            line = reader.line_num
            if not row:  # a blank line (e.g. trailing newline) is not a row
                continue
            row_number += 1
            where = f"{path.name}:{line}"
            if len(row) != num_fields:
                result.malformed.append(f"{where}: {len(row)} fields, expected {num_fields}")
                continue
            text_a, text_b = row[a].strip(), (row[b].strip() if b is not None else None)
            # Test rows are kept even with an empty text: the server wants a prediction for every index.
            if with_labels and (not text_a or (b is not None and not text_b)):
                result.malformed.append(f"{where}: empty text")
                continue
            label = None
            if lab is not None:
                raw = row[lab].strip()
                if label_ids is None:
                    try:
                        label = float(raw)
                    except ValueError:
                        result.malformed.append(f"{where}: score {raw!r} is not a number")
                        continue
                    if not SCORE_RANGE[0] <= label <= SCORE_RANGE[1]:  # also NaN and inf
                        result.malformed.append(f"{where}: score {raw!r} is outside {SCORE_RANGE[0]:g} to "
                                                f"{SCORE_RANGE[1]:g}")
                        continue
                elif raw in label_ids:
                    label = label_ids[raw]
                else:
                    result.malformed.append(f"{where}: unknown label {raw!r} (expected one of {', '.join(labels)})")
                    continue
            index = row[idx].strip() if idx is not None else str(row_number)
            if not with_labels and index in first_seen:  # the server takes one prediction per test index
                result.malformed.append(f"{where}: index {index!r} again (first at line {first_seen[index]})")
                continue
            first_seen.setdefault(index, line)
            result.examples.append(Example(index, text_a, text_b, label))
    return result


def read_split(glue_dir: Path, task: Task, split: str) -> ReadResult:
    """``split`` is "train", a dev split name (``task.dev``) or a test file name (``task.test``)."""
    folder = Path(glue_dir) / task.folder
    if split == "train":
        file, columns = task.train
        return read_tsv(folder / file, columns, task.labels)
    if split in task.dev:
        file, columns = task.dev[split]
        return read_tsv(folder / file, columns, task.labels)
    if split in task.test:
        file, columns = task.test[split]
        return read_tsv(folder / file, columns, task.labels, with_labels=False)
    raise GlueDataError(f"{task.name} has no split {split!r} (train, {', '.join(task.dev)}, {', '.join(task.test)})")


def submission_file_names(task: Task) -> List[str]:
    """The task's files in a leaderboard submission: MNLI-m.tsv, ..., and AX.tsv for MNLI (predicted with its
    model)."""
    return [*task.test, *(["AX.tsv"] if task.name == "MNLI" else [])]


def submission_sources(glue_dir: Path, task: Task) -> Dict[str, Callable[[], ReadResult]]:
    """Each of the task's submission files with the reader of its test file."""
    return {name: (lambda name=name: read_ax(glue_dir) if name == "AX.tsv" else read_split(glue_dir, task, name))
            for name in submission_file_names(task)}


def submission_source_exists(glue_dir: Path, task: Task, submission_file: str) -> bool:
    if submission_file == "AX.tsv":
        return find_ax(glue_dir) is not None
    return submission_file in task.test and (Path(glue_dir) / task.folder / task.test[submission_file][0]).is_file()


def find_ax(glue_dir: Path) -> Optional[Path]:
    """The diagnostic set's file, wherever the common layouts put it; None when absent."""
    for rel in AX_FILES:
        if (Path(glue_dir) / rel).is_file():
            return Path(glue_dir) / rel
    return None


def read_ax(glue_dir: Path) -> ReadResult:
    path = find_ax(glue_dir)
    if path is None:
        raise MissingGlueFile(f"no diagnostic (AX) file under {glue_dir} (looked for {', '.join(AX_FILES)})")
    return read_tsv(path, AX_COLUMNS, TASKS["MNLI"].labels, with_labels=False)
