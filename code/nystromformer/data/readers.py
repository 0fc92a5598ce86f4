"""One reader per corpus. Each turns its dataset's raw files into a stream of plain-text documents.

Readers never crash on bad input: a malformed record is skipped and reported to a ``SkipLog``, which names the
first few offenders (file:line) in the log and keeps totals for the stats file.
"""
from __future__ import annotations

import codecs
import json
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

log = logging.getLogger("nystromformer.data")

# Paper defaults: Wikipedia keeps articles of >= 128 words, RealNews >= 1000 words.
MIN_WORDS = {"wiki": 128, "bookcorpus": 0, "stories": 0, "realnews": 1000}
# BookCorpus files carry no book boundaries; see bookcorpus_documents for why 1000 sentences.
SENTENCES_PER_DOCUMENT = 1000


class SkipLog:
    """Counts skipped input by reason and logs the first ``show`` offenders of each reason."""

    def __init__(self, show: int = 5):
        self.show = show
        self.counts: Counter = Counter()
        self.examples: Dict[str, List[str]] = {}

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < self.show:
            shown.append(f"{where}: {detail}" if detail else where)
            log.warning("skipped (%s) %s%s", reason, where, f": {detail}" if detail else "")
        elif self.counts[reason] == self.show + 1:
            log.warning("more %r skips; only totals from now on (see the stats file)", reason)

    def as_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "first_examples": self.examples}


def expand_inputs(inputs: Sequence[Path], pattern: str = "*") -> List[Path]:
    """Files named directly, plus the files matching ``pattern`` below each named folder, in sorted order. A file
    reached twice (overlapping inputs: a folder and a file in it, a link) is read once, with a warning: read twice,
    its documents would be in the corpus twice, possibly once in dev and once in train. Below a named folder, hidden
    files and everything in hidden folders (a name starting with "."; ``.git``, ``.ipynb_checkpoints`` holding
    copies of the inputs) are not read."""
    files: List[Path] = []
    seen: Dict[Path, Path] = {}
    for path in map(Path, inputs):
        if path.is_dir():
            found = sorted(p for p in path.rglob(pattern)
                           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.is_file():
            found = [path]
        else:
            raise FileNotFoundError(f"{path}: input does not exist")
        for file in found:
            first = seen.setdefault(file.resolve(), file)
            if first is file:
                files.append(file)
            else:
                log.warning("%s: already an input (as %s); read once", file, first)
    return files


def _decoded_lines(path: Path, skips: Optional[SkipLog]) -> Iterator[tuple]:
    """(line number, text, None) for each line, or (line number, None, the UnicodeDecodeError) for a line with
    undecodable bytes, counted in ``skips`` (None: the caller counts, once per document it drops). A byte-order
    mark opening the file (as Windows editors write UTF-8) is not text: it is dropped."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n"), None
            except UnicodeDecodeError as e:
                if skips is not None:
                    skips.skip("undecodable_bytes", f"{path}:{number}", str(e))
                yield number, None, e


def _is_empty(path: Path, skips: SkipLog) -> bool:
    if path.stat().st_size == 0:
        skips.skip("empty_file", str(path))
        return True
    return False


def _split_lines(text: str) -> List[str]:
    # Lines end at \n or \r\n only, as in the line-by-line readers: str.splitlines() would also split at
    # U+2028, \x0c, \x85 and others, which BookCorpus and Wikipedia keep inside a line.
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def _join_paragraphs(lines: Iterable[str]) -> str:
    # A document keeps its line breaks but never contains a blank line: blank lines separate documents.
    return "\n".join(line.strip() for line in lines if line.strip())


DOC_OPEN = re.compile(r'^<doc id="[^"]*" url="[^"]*" title="[^"]*">$')
# wikiextractor writes the text HTML-escaped (its --html-safe is on by default: & < > become &amp; &lt; &gt;).
# _wiki_text undoes exactly that, in one pass; html.unescape would also decode entity-like text of the article.
WIKIEXTRACTOR_ESCAPES = {"&amp;": "&", "&lt;": "<", "&gt;": ">"}
ESCAPED = re.compile("|".join(WIKIEXTRACTOR_ESCAPES))
# Transclusion markup wikiextractor does not know and leaves in the text: wikitext control, not prose.
TRANSCLUSION_TAG = re.compile(r"</?(?:onlyinclude|includeonly|noinclude)\s*/?>", re.IGNORECASE)


def _wiki_text(line: str) -> str:
    return TRANSCLUSION_TAG.sub("", ESCAPED.sub(lambda m: WIKIEXTRACTOR_ESCAPES[m[0]], line))


def wiki_documents(files: Sequence[Path], skips: SkipLog) -> Iterator[str]:
    """wikiextractor output: ``<doc id=.. url=.. title=..>``, the title line, the text (HTML-escaped: unescaped
    here), ``</doc>``."""
    for path in files:
        if _is_empty(path, skips):
            continue
        body: Optional[List[str]] = None  # lines of the open document; None outside a document
        start = 0
        broken = False
        for number, line, error in _decoded_lines(path, None):
            if line is None:  # undecodable bytes: drop the whole document they sit in, counted once
                if not broken:
                    skips.skip("undecodable_bytes", f"{path}:{number}", f"{error}; whole article skipped")
                broken = True
                continue
            if line.startswith("<doc"):
                if body is not None:
                    skips.skip("malformed_doc_tag", f"{path}:{start}", "<doc> without </doc>")
                if not DOC_OPEN.match(line):
                    skips.skip("malformed_doc_tag", f"{path}:{number}", f"bad opening tag {line[:80]!r}")
                    body = None
                    start = number
                    broken = True
                    continue
                body, start, broken = [], number, False
            elif line == "</doc>":
                if body is None:
                    if not broken:
                        skips.skip("malformed_doc_tag", f"{path}:{number}", "</doc> without <doc>")
                elif not broken:
                    yield _join_paragraphs(body[1:])  # body[0] is the title line
                body, broken = None, False
            elif body is not None:
                body.append(_wiki_text(line))
        if body is not None:
            skips.skip("malformed_doc_tag", f"{path}:{start}", "<doc> not closed at end of file")


def bookcorpus_documents(files: Sequence[Path], skips: SkipLog,
                         sentences_per_document: int = SENTENCES_PER_DOCUMENT,
                         document_per_file: bool = False) -> Iterator[str]:
    """BookCorpus in one of two layouts.

    ``books_large_p1.txt``-style files (the default): one sentence per line, no book boundaries. A document ends
    at a blank line (if a copy keeps book breaks as blank lines) or after ``sentences_per_document`` sentences.
    Why a fixed count: the files hold ~74M sentences with no boundaries, one document per file would be a
    multi-GB string, and documents only decide where the ``</s>`` separators fall in the token stream; 1000
    sentences (~13k words, a few chapters) keeps separators rare, like the paper's book-level documents.

    ``document_per_file``: a folder of one ``.txt`` file per book, blank lines between paragraphs. Each file is
    one document (blank lines are paragraph breaks, dropped like every blank line inside a document).
    """
    for path in files:
        if _is_empty(path, skips):
            continue
        sentences: List[str] = []
        undecodable = False
        for _, line, _ in _decoded_lines(path, skips):
            if line is None:
                undecodable = True
                continue  # that one sentence is dropped (and counted)
            if line.strip():
                sentences.append(line)
            if document_per_file:
                continue
            if sentences and (not line.strip() or len(sentences) >= sentences_per_document):
                yield _join_paragraphs(sentences)
                sentences = []
        if sentences:
            yield _join_paragraphs(sentences)
        elif document_per_file and not undecodable:  # (a book of undecodable lines only is counted as those)
            skips.skip("empty_file", str(path), "only whitespace")


def stories_documents(files: Sequence[Path], skips: SkipLog) -> Iterator[str]:
    """A folder of story text files (Trinh & Le's CommonCrawl "Stories"), one document per file."""
    for path in files:
        if _is_empty(path, skips):
            continue
        raw = path.read_bytes()
        raw = raw[len(codecs.BOM_UTF8):] if raw.startswith(codecs.BOM_UTF8) else raw  # a byte-order mark is not text
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            skips.skip("undecodable_bytes", f"{path}:{line}", f"{e}; whole story skipped")
            continue
        document = _join_paragraphs(_split_lines(text))
        if not document:
            skips.skip("empty_file", str(path), "only whitespace")
            continue
        yield document


def realnews_documents(files: Sequence[Path], skips: SkipLog) -> Iterator[str]:
    """``realnews.jsonl``: one JSON object per line with the article in ``text``."""
    for path in files:
        if _is_empty(path, skips):
            continue
        for number, line, _ in _decoded_lines(path, skips):
            if line is None or not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:  # (JSONDecodeError; a 5000-digit number; [[[[... nested)
                skips.skip("bad_json", f"{path}:{number}", f"{type(e).__name__}: {str(e)[:200]}")
                continue
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                skips.skip("missing_text", f"{path}:{number}", "no string 'text' field")
                continue
            try:  # JSON's \ud83d escape alone (half an emoji, cut off by a scraper) is no text UTF-8 can hold
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                skips.skip("lone_surrogate", f"{path}:{number}", str(e))
                continue
            yield _join_paragraphs(_split_lines(text))


READERS = {"wiki": wiki_documents, "bookcorpus": bookcorpus_documents,
           "stories": stories_documents, "realnews": realnews_documents}
# Which files each reader takes from a folder given as --input.
INPUT_PATTERNS = {"wiki": "wiki_*", "bookcorpus": "*.txt", "stories": "*.txt", "realnews": "*.jsonl"}
