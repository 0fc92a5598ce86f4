"""LRA ListOps: generator, an independent evaluator, the LRA TSV format, and the token vocabulary.

The generator follows LRA's ``listops.py``: operators MAX, MIN, MED (median, truncated to an int as
``int(np.median(...))``) and SM (sum mod 10) over digits 0-9; a node below ``max_depth`` is an operator
with probability 0.25 (else a digit), an operator takes 2..``max_args`` arguments, the root is always an
operator; trees are drawn until their token count lies in [min_length, max_length] (defaults 501 and 1999:
LRA's 500 < L < 2000; depth 10, 10 args) and duplicates are dropped (so the splits, cut in order from one seeded stream, are disjoint). As in LRA, ``max_depth`` counts the digit level: the
root is at depth 1 and only digits sit at depth ``max_depth``, so operators nest at most max_depth − 1 deep.

Text format: LRA's TSV has a ``Source\\tTarget`` header; sources are space-separated tokens such as
``[MAX 4 3 [MIN 2 3 ] 1 0 ]``. The LRA release also wraps sub-expressions in ``(`` ``)`` tokens; the
loader drops them (as LRA's input pipeline does), so both forms load to the same tokens.

Labels of generated trees come from evaluating the tree structure; ``evaluate_expression`` is a separate
recursive-descent parser over the token string, used to check them.
"""
from __future__ import annotations

import csv
import random
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from tqdm import tqdm

from .. import atomic
from ..errors import UserError, first_undecodable_line


class ListOpsDataError(UserError, ValueError):
    """An LRA ListOps file or folder that cannot be used as it is; the message names it (and the line)."""


OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
END = "]"
OPERATOR_P = 0.25  # LRA's VALUE_P: the probability that a node below max depth is an operator
VOCAB = ["<pad>", "<unk>"] + [str(d) for d in range(10)] + list(OPERATORS) + [END]
PAD_ID = 0
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
NUM_CLASSES = 10
SPLIT_FILES = {"train": "basic_train.tsv", "dev": "basic_val.tsv", "test": "basic_test.tsv"}

Tree = Union[int, Tuple[str, list]]
GIVE_UP_FACTOR = 64  # a tree is abandoned once it has more than this × max_length tokens (see generate)
MAX_DEPTH = 500  # deeper recursion than Python's default limit allows


def _apply(op: str, args: Sequence[int]) -> int:
    if op == "[MAX":
        return max(args)
    if op == "[MIN":
        return min(args)
    if op == "[MED":
        s = sorted(args)
        m = len(s) // 2
        return s[m] if len(s) % 2 else (s[m - 1] + s[m]) // 2  # int(np.median) for non-negative ints
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown operator {op!r}")


class _TooLong(Exception):
    pass


def generate_tree(rng: random.Random, depth: int, max_depth: int, max_args: int,
                  give_up_after: Optional[int] = None) -> Tuple[Tree, int]:
    """A random tree and its token count (LRA's generate_tree, minus the binarised tuples). With
    ``give_up_after``, a tree that grows past that many tokens is abandoned (_TooLong) instead of completed."""
    is_op = depth == 1 or (depth < max_depth and rng.random() < OPERATOR_P)
    if not is_op:
        return rng.randrange(10), 1
    op = rng.choice(OPERATORS)
    args, length = [], 2
    for _ in range(rng.randint(2, max_args)):
        sub, sub_len = generate_tree(rng, depth + 1, max_depth, max_args, give_up_after)
        args.append(sub)
        length += sub_len
        if give_up_after is not None and length > give_up_after:
            raise _TooLong
    return (op, args), length


def tree_value(t: Tree) -> int:
    return t if isinstance(t, int) else _apply(t[0], [tree_value(a) for a in t[1]])


def tree_tokens(t: Tree) -> List[str]:
    if isinstance(t, int):
        return [str(t)]
    out = [t[0]]
    for a in t[1]:
        out.extend(tree_tokens(a))
    out.append(END)
    return out


def generate(num_samples: int, seed: int, max_depth: int = 10, max_args: int = 10, min_length: int = 501,
             max_length: int = 1999, max_tries: int = 10_000_000) -> List[Tuple[str, int]]:
    """``num_samples`` distinct (source, label) pairs with min_length ≤ tokens ≤ max_length."""
    rng = random.Random(seed)
    seen, out = set(), []
    # Trees grow exponentially with depth (at depth 10 the longest of 44k draws had 6,216 tokens, at 16 68k):
    # one far beyond max_length is abandoned rather than completed. The draws of every tree that is completed are
    # LRA's, so at LRA's settings, where no tree comes near this bound, the data is that of full generation.
    give_up_after = GIVE_UP_FACTOR * max_length
    progress = tqdm(total=num_samples, desc="generating ListOps trees", unit=" trees", mininterval=2,
                    disable=num_samples < 1000)
    for tries in range(max_tries):
        if len(out) == num_samples:
            break
        try:
            tree, length = generate_tree(rng, 1, max_depth, max_args, give_up_after)
        except _TooLong:
            continue
        if not (min_length <= length <= max_length):
            continue
        source = " ".join(tree_tokens(tree))
        if source in seen:
            continue
        seen.add(source)
        out.append((source, tree_value(tree)))
        progress.update()
        progress.set_postfix(tries=tries + 1, refresh=False)
    progress.close()
    if len(out) == num_samples:  # (also when the last try drew the last tree)
        return out
    raise ListOpsDataError(f"only {len(out)} of {num_samples} distinct trees with {min_length} <= length <= "
                           f"{max_length} at depth <= {max_depth} after {max_tries} tries; widen the limits")


def longest_tree(max_depth: int, max_args: int) -> int:
    """Tokens of the longest tree the generator can draw: operators at depths 1..max_depth−1 with max_args
    arguments each, digits at depth max_depth."""
    length = 1
    for _ in range(max_depth - 1):
        length = 2 + max_args * length
    return length


def generate_splits(sizes: dict, seed: int = 0, **kw) -> dict:
    """Disjoint splits, in the order given, cut from one seeded stream of distinct trees."""
    rows = generate(sum(sizes.values()), seed, **kw)
    out, i = {}, 0
    for split, n in sizes.items():
        out[split] = rows[i:i + n]
        i += n
    return out


# ---- independent evaluator: recursive descent over the token string -------------------------------------
def evaluate_expression(source: str) -> int:
    """Value of a ListOps expression given as text (parentheses allowed), by recursive descent."""
    tokens = [t for t in source.split() if t not in ("(", ")")]
    pos = 0

    def expr() -> int:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError("unexpected end of expression")
        tok = tokens[pos]
        pos += 1
        if tok.isdigit() and len(tok) == 1:
            return int(tok)
        if tok not in OPERATORS:
            raise ValueError(f"unexpected token {tok!r} at {pos - 1}")
        vals = []
        while pos < len(tokens) and tokens[pos] != END:
            vals.append(expr())
        if pos >= len(tokens):
            raise ValueError(f"missing ']' for {tok}")
        pos += 1
        if not vals:
            raise ValueError(f"{tok} without arguments")
        if tok == "[MAX":
            acc = vals[0]
            for x in vals[1:]:
                acc = x if x > acc else acc
            return acc
        if tok == "[MIN":
            acc = vals[0]
            for x in vals[1:]:
                acc = x if x < acc else acc
            return acc
        if tok == "[SM":
            acc = 0
            for x in vals:
                acc = (acc + x) % 10
            return acc
        # [MED: count-based median (no sorting), mean of the two middle values floored for even counts
        counts = [0] * 10
        for x in vals:
            counts[x] += 1
        n = len(vals)

        def kth(k):  # k-th smallest, 0-based
            run = 0
            for digit in range(10):
                run += counts[digit]
                if run > k:
                    return digit
            raise AssertionError
        return kth(n // 2) if n % 2 else (kth(n // 2 - 1) + kth(n // 2)) // 2

    value = expr()
    if pos != len(tokens):
        raise ValueError(f"trailing tokens after position {pos}")
    return value


def expression_depth(source: str) -> int:
    depth = best = 0
    for t in source.split():
        if t in OPERATORS:
            depth += 1
            best = max(best, depth)
        elif t == END:
            depth -= 1
    return best


# ---- files -----------------------------------------------------------------------------------------------
def write_tsv(path: Path, rows: Iterable[Tuple[str, int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_open(path, "w") as f:
        f.write("Source\tTarget\n")
        for src, lab in rows:
            f.write(f"{src}\t{lab}\n")


def read_tsv(path: Path) -> List[Tuple[List[str], int]]:
    """Rows of an LRA ListOps TSV (``Source\\tTarget`` header) as (tokens without parentheses, label)."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:  # streamed: LRA's training file is ~0.3 GB
            return _read_rows(path, csv.reader(f, delimiter="\t"))
    except UnicodeDecodeError as e:
        raise ListOpsDataError(f"{path}:{first_undecodable_line(path)}: not UTF-8 ({e.reason})") from None


def _read_rows(path: Path, reader) -> List[Tuple[List[str], int]]:
    header = next(reader, None)
    if header is None or [h.strip() for h in header[:2]] != ["Source", "Target"]:
        raise ListOpsDataError(f"{path}: expected a 'Source<TAB>Target' header, got {header!r}")
    rows = []
    for lineno, row in enumerate(reader, start=2):
        if not row:
            continue
        if len(row) != 2:
            raise ListOpsDataError(f"{path}:{lineno}: expected 2 tab-separated columns, got {len(row)}")
        tokens = [t for t in row[0].split() if t not in ("(", ")")]
        unknown = sorted(set(tokens).difference(TOKEN_ID))
        if unknown:
            raise ListOpsDataError(f"{path}:{lineno}: unknown token(s) {', '.join(map(repr, unknown[:5]))} "
                                   f"(ListOps has digits 0-9, {' '.join(OPERATORS)} and ])")
        try:
            label = int(row[1])
        except ValueError:
            raise ListOpsDataError(f"{path}:{lineno}: label {row[1]!r} is not an integer") from None
        if not 0 <= label < NUM_CLASSES:
            raise ListOpsDataError(f"{path}:{lineno}: label {label} outside 0-9")
        rows.append((tokens, label))
    return rows


def load_lra_dir(folder: Path) -> dict:
    """The LRA release's ``basic_{train,val,test}.tsv`` from ``folder`` as {train, dev, test}."""
    folder = Path(folder)
    missing = [f for f in SPLIT_FILES.values() if not (folder / f).is_file()]
    if missing:
        raise ListOpsDataError(f"{folder}: missing {', '.join(missing)} (the LRA release's listops-1000 folder)")
    splits = {split: read_tsv(folder / name) for split, name in SPLIT_FILES.items()}
    for split, name in SPLIT_FILES.items():
        if not splits[split]:
            raise ListOpsDataError(f"{folder / name}: no rows after the header")
    return splits


def encode(tokens: Sequence[str], max_length: int) -> List[int]:
    """Token ids, truncated to max_length (as LRA does)."""
    unk = TOKEN_ID["<unk>"]
    return [TOKEN_ID.get(t, unk) for t in tokens[:max_length]]
