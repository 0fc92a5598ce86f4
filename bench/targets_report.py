"""Issue #6's ten targets, judged from the files of one GPU run: one table of target, setting, figure and verdict.

    python bench/targets_report.py RESULTS/targets --tests RESULTS/check/gpu-tests.txt

The folder holds what the `targets` stage of bench/gpu_session.sh writes (each file optional; the targets a
missing file would measure are "not measured", never guessed):

    attention.csv   bench/attention_speed.py --csv: fwd+bwd time, × SDPA, × the bandwidth floor, peak memory and
                    relative error against the fp32 reference, one row per (n, implementation); with --graphs
                    also the CUDA-graph replay (the kernels' own time), shown beside the timed figure
    model-*.csv     bench/model_speed.py --csv, one file per setting (n, attention dtype, conv): tokens/s, × softmax,
                    × transformers' Nyströmformer, peak memory, one row per model
    --tests FILE    the GPU tests' pytest output (the check stage's gpu-tests.txt), for the correctness target

Each target is judged per setting (an attention implementation; a training setting and model of ours), and
counts as met where every setting meets it, "met in some" where only some do. The thresholds are the issue's
own, written once in TARGETS below. Never met on less than was asked: the "every n" targets (floor, flat memory)
fail if a length failed and are not judged if one of the issue's lengths (512, 4096, 16384, 65536) or the table's
is missing; a NaN is a failure; the tolerance target needs the GPU tests (the table checks forward outputs alone)
and fails on any failing test or any error over the bound in the table; the softmax baseline is SDPA in bf16, also
for tables with fp32 attention; the floor is the issue's 9 tensors (older CSVs, whose floor counted 12, are
scaled). Prints Markdown; exits 2 when the folder does not exist.
"""
from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# (key, the issue's words). Attention: 65,536 tokens per batch, bf16; training: BERT-base size, bf16 autocast.
TARGETS = [
    ("attn-512", "attention fwd+bwd ≤ 1.0× SDPA at n = 512"),
    ("attn-4096", "attention fwd+bwd ≤ 0.25× SDPA at n = 4096"),
    ("attn-65536", "attention fwd+bwd ≤ 0.05× SDPA at n = 65,536"),
    ("floor", "attention within 5× of the bandwidth floor (every n)"),
    ("attn-memory", "attention peak memory linear in n (flat at a fixed 65,536 tokens: largest ≤ 1.5× smallest)"),
    ("tolerance", "outputs and gradients within bf16 tolerance of the fp32 reference (rel. err. ≤ 1e-2; GPU tests)"),
    ("train-512", "training at 512 ≥ 1.2× the softmax model's tokens/s"),
    ("train-hf", "training at 512 ≥ 2.5× transformers' NystromformerForMaskedLM"),
    ("train-4096", "training at 4096 ≥ 2× the softmax model's tokens/s"),
    ("train-memory", "training peak memory ≤ the softmax model's"),
]
ATTENTION_RATIO = {"attn-512": (512, 1.0), "attn-4096": (4096, 0.25), "attn-65536": (65536, 0.05)}
ISSUE_LENGTHS = (512, 4096, 16384, 65536)  # the issue's table (attention_speed.py's default): "every n" needs each
FLOOR_MAX, FLAT_MAX, REL_ERR_MAX = 5.0, 1.5, 1e-2
ISSUE_FLOOR_TENSORS = 9  # read q, k, v, o, dO and write o, dq, dk, dv once
TRAIN_RATIO = {"train-512": (512, "vs_softmax", 1.2), "train-hf": (512, "vs_hf_nystromformer", 2.5),
               "train-4096": (4096, "vs_softmax", 2.0)}


@dataclass
class Verdict:
    target: str          # a key of TARGETS
    setting: str
    figure: str          # what was measured, in words and numbers
    met: bool | None     # None: not measured


def number(cell: str | None) -> float | None:
    """A CSV cell as a float; empty (the benchmark's None) or unparsable → None. NaN stays NaN: a measurement that
    came out NaN is a failure, never "not measured"."""
    try:
        return float(cell) if cell not in (None, "") else None
    except ValueError:
        return None


def failed(row: dict, column: str) -> bool:
    """The row ran and has no usable figure: failed, out of memory (an empty cell), or not finite."""
    value = number(row[column])
    return value is None or not math.isfinite(value)


def is_nan(row: dict, column: str) -> bool:
    """The cell holds a figure that came out NaN or infinite (an empty cell is "none", e.g. no peak on the CPU)."""
    value = number(row[column])
    return value is not None and not math.isfinite(value)


def floor_ratio(row: dict) -> float | None:
    """× issue #6's floor of 9 tensors. Tables before 2026-11-29 have no ``floor_tensors`` column: their floor
    counted 12 tensors (q, k, v read again by the backward), so their ratio is scaled to the issue's."""
    ratio = number(row["x_floor"])
    tensors = number(row.get("floor_tensors")) or 12
    return None if ratio is None else ratio * tensors / ISSUE_FLOOR_TENSORS


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def judge_attention(rows: list[dict], impls: list[str]) -> list[Verdict]:
    verdicts = []
    by = {(int(r["n"]), r["impl"]): r for r in rows}
    # a run stopped before its longest lengths has no rows for them: missing, not judged on the rest
    lengths = sorted({n for n, _ in by} | set(ISSUE_LENGTHS))
    sdpa_peaks = [number(by[n, "sdpa"]["peak_mib"]) for n in lengths if (n, "sdpa") in by]
    for impl in impls:
        mine = [by[n, impl] for n in lengths if (n, impl) in by]
        for key, (n, bound) in ATTENTION_RATIO.items():
            row, sdpa = by.get((n, impl)), by.get((n, "sdpa"))
            if row is None or sdpa is None:
                verdicts.append(Verdict(key, impl, "not measured", None))
                continue
            if failed(row, "ms"):  # the row ran and failed, or ran out of memory: the table says which
                verdicts.append(Verdict(key, impl, "no time: failed or out of memory (see the table)", False))
                continue
            ratio = number(row["vs_sdpa"])
            if ratio is None or not math.isfinite(ratio):
                verdicts.append(Verdict(key, impl, "not measured (SDPA failed: see the table)", None))
                continue
            figure = f"{ratio:.3f}× ({number(row['ms']):.3f} vs {number(sdpa['ms']):.3f} ms)"
            graph = number(row.get("graph_vs_sdpa"))
            if graph is not None:
                figure += f"; CUDA graph {graph:.3f}×"
            verdicts.append(Verdict(key, impl, figure, ratio <= bound))
        # "every n": a length the table has (SDPA's included) with no figure of this impl is no pass
        # a NaN floor ratio or peak (a NaN bandwidth, say) is a failure of that length, not left out
        failures = [r["n"] for r in mine if failed(r, "ms") or is_nan(r, "x_floor") or is_nan(r, "peak_mib")]
        missing = [str(n) for n in lengths if (n, impl) not in by]
        measured = [r for r in mine if r["n"] not in failures]
        gaps = "; " + ", ".join(filter(None, [f"failed at n = {', '.join(failures)}" if failures else "",
                                            f"not measured at n = {', '.join(missing)}" if missing else ""]))
        gaps = gaps if failures or missing else ""
        whole = False if failures else None if missing else True  # a verdict only with every length measured
        floors = [floor_ratio(r) for r in measured if floor_ratio(r) is not None]
        if floors:
            figure = f"{span(floors, '.1f')}× over n = {lengths_of(measured)}{gaps}"
            graph = [floor_ratio({"x_floor": r.get("graph_x_floor"), "floor_tensors": r.get("floor_tensors")})
                     for r in measured]
            graph = [g for g in graph if g is not None]
            if graph:
                figure += f"; CUDA graph {span(graph, '.1f')}×"
            bandwidth = number(measured[0].get("bandwidth_gbs"))
            if bandwidth:
                figure += f" (copy bandwidth {bandwidth / 1e3:.2f} TB/s)"
            # one length over the bound fails "every n" whatever the missing lengths would show
            met = False if failures or max(floors) > FLOOR_MAX else whole
            verdicts.append(Verdict("floor", impl, figure, met))
        else:
            verdicts.append(Verdict("floor", impl, "not measured" + gaps, False if failures else None))
        peaks = [number(r["peak_mib"]) for r in measured if number(r["peak_mib"]) is not None]
        if len(peaks) >= 2:
            figure = f"{span(peaks, '.0f')} MiB over n = {lengths_of(measured)}{gaps}"
            if sdpa_peaks and all(p is not None for p in sdpa_peaks):
                figure += f" (SDPA {span(sdpa_peaks, '.0f')})"
            met = False if failures or max(peaks) > FLAT_MAX * min(peaks) else whole
            verdicts.append(Verdict("attn-memory", impl, figure, met))
        else:
            why = "no peak memory (CUDA only)" if not peaks else "one length only"
            verdicts.append(Verdict("attn-memory", impl, f"not measured ({why}){gaps}", False if failures else None))
        timed = [r for r in mine if not failed(r, "ms")]  # (the error of a row whose floor or peak is NaN counts)
        errors = [number(r["rel_err"]) for r in timed]
        if timed and all(e is not None for e in errors):
            bad = [r["n"] for r, e in zip(timed, errors) if not math.isfinite(e)]
            if bad:
                verdicts.append(Verdict("tolerance", impl, f"rel. err. not finite at n = {', '.join(bad)}", False))
            else:
                verdicts.append(Verdict("tolerance", impl, f"rel. err. ≤ {max(errors):.1e}",
                                        max(errors) <= REL_ERR_MAX))
        else:
            verdicts.append(Verdict("tolerance", impl, "not measured (run with --check)", None))
    return verdicts


def span(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if format(low, fmt) == format(high, fmt) else f"{low:{fmt}}–{high:{fmt}}"


def lengths_of(rows: list[dict]) -> str:
    return ", ".join(r["n"] for r in rows)


def judge_tests(path: Path | None) -> Verdict:
    """The GPU tests' pytest output (the check stage's gpu-tests.txt, those tests alone): met when its summary says
    some passed and none failed or errored; a run cut off before its summary, or one that ran no test, is not."""
    if path is None:
        return Verdict("tolerance", "GPU tests", "not read (no --tests file)", None)
    if not path.is_file():
        return Verdict("tolerance", "GPU tests", f"not read (no file {path}: the check stage not run?)", None)
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    summaries = [line for line in path.read_text().splitlines()
                 if re.search(r"\b\d+ (passed|failed|errors?|skipped|deselected)\b", line) and " in " in line]
    for line in summaries:
        for count, word in re.findall(r"\b(\d+) (passed|failed|errors?|skipped)\b", line):
            counts["error" if word.startswith("error") else word] += int(count)
    if not summaries:
        return Verdict("tolerance", "GPU tests", "no pytest summary (stopped before the end?)", False)
    figure = ", ".join(f"{counts[k]} {k if k != 'error' else 'errors'}" for k in counts)
    if counts["passed"] == 0:
        figure += " (no test ran)"
    return Verdict("tolerance", "GPU tests", figure, counts["failed"] == counts["error"] == 0 and counts["passed"] > 0)


def setting_of(rows: list[dict]) -> str:
    first = rows[0]
    dtype = "fp32 attention" if first["attention_fp32"] == "true" else "bf16 attention"
    extra = "" if first["compile"] == "none" else f", compile {first['compile']}"
    return f"n = {first['seq_len']}, batch {first['batch']}, conv {first['conv']}, {dtype}{extra}"


def judge_training(tables: list[list[dict]], models: list[str]) -> list[Verdict]:
    """The softmax baseline is SDPA in bf16 (FlashAttention): a table with fp32 attention, whose own softmax model
    runs SDPA in fp32 (no FlashAttention: slower, more memory), is judged against the bf16 table's softmax row of
    its length and batch, and not judged without one."""
    verdicts = []
    bf16_softmax = {(t[0]["seq_len"], t[0]["batch"]): r for t in tables if t[0]["attention_fp32"] != "true"
                    for r in t if r["model"] == "softmax"}
    for rows in tables:
        n, setting = int(rows[0]["seq_len"]), setting_of(rows)
        by = {r["model"]: r for r in rows}
        fp32 = rows[0]["attention_fp32"] == "true"
        soft = bf16_softmax.get((rows[0]["seq_len"], rows[0]["batch"])) if fp32 else by.get("softmax")
        soft_words = "the bf16-attention table's softmax" if fp32 else "softmax"
        for model in models:
            row = by.get(model)
            if row is None:
                continue
            label = f"{setting}: {model}"
            if failed(row, "tokens_per_s"):  # built, then failed or ran out of memory: no figure at all
                for key, (length, _, _) in TRAIN_RATIO.items():
                    if length == n:
                        verdicts.append(Verdict(key, label, "failed or out of memory (see the table)", False))
                verdicts.append(Verdict("train-memory", label, "failed or out of memory (see the table)", False))
                continue
            tps = number(row["tokens_per_s"])
            for key, (length, column, bound) in TRAIN_RATIO.items():
                if length != n:
                    continue
                if column == "vs_softmax":
                    base = soft_words
                    ratio = tps / number(soft["tokens_per_s"]) if soft and not failed(soft, "tokens_per_s") else None
                else:
                    base = "hf-nystromformer"
                    ratio = number(row[column])
                if ratio is None or not math.isfinite(ratio):
                    verdicts.append(Verdict(key, label, f"no ratio ({base} not measured or failed)", None))
                else:
                    figure = f"{ratio:.2f}× ({tps:,.0f} tokens/s)"
                    if column == "vs_softmax" and fp32:
                        figure += f" vs {soft_words} model"
                    verdicts.append(Verdict(key, label, figure, ratio >= bound))
            peak = number(row["peak_mib"])
            soft_peak = number(soft["peak_mib"]) if soft and not failed(soft, "tokens_per_s") else None
            if peak is None or soft_peak is None:
                why = (f"no {soft_words} row" if soft is None else f"{soft_words} failed"
                       if failed(soft, "tokens_per_s") else "no peak memory (CUDA only)")
                verdicts.append(Verdict("train-memory", label, f"not measured ({why})", None))
            else:
                figure = f"{peak:,.0f} vs {soft_peak:,.0f} MiB ({peak / soft_peak - 1:+.1%})"
                if fp32:
                    figure += f" vs {soft_words} model"
                verdicts.append(Verdict("train-memory", label, figure, peak <= soft_peak))
    return verdicts


def state_of(key: str, verdicts: list[Verdict]) -> str:
    """"met" (every setting judged meets it), "some" (only some do), "not met", or "not measured"."""
    judged = [v for v in verdicts if v.target == key and v.met is not None]
    if not judged:
        return "not measured"
    if key == "tolerance":
        # correctness: a failing GPU test (or none run), or an error over the bound in the table, fails it whatever
        # the rest shows; the table checks forward outputs alone (gradients, padding, uneven n are the tests'), so
        # it can fail the target, not meet it
        if any(v.met is False for v in judged):
            return "not met"
        return "met" if any(v.setting == "GPU tests" for v in judged) else "not measured"
    return "met" if all(v.met for v in judged) else "some" if any(v.met for v in judged) else "not met"


def summary(verdicts: list[Verdict]) -> list[str]:
    """A count of each state (the status line of docs/performance.md), then one line per target, naming the
    settings that meet it where only some do."""
    states = {key: state_of(key, verdicts) for key, _ in TARGETS}
    counts = {state: list(states.values()).count(state) for state in ("met", "some", "not met", "not measured")}
    lines = [f"Of {len(TARGETS)} targets: {counts['met']} met, {counts['some']} met only in some settings, "
             f"{counts['not met']} not met, {counts['not measured']} not measured."]
    for key, words in TARGETS:
        state = states[key]
        if state == "some":
            state = "met only in: " + "; ".join(v.setting for v in verdicts if v.target == key and v.met)
        lines.append(f"- {words}: " + ("**met**" if state == "met" else state))
    return lines


def report(folder: Path, tests: Path | None, impls: list[str], models: list[str]) -> str:
    verdicts, sources, devices = [], [], set()
    attention = folder / "attention.csv"
    if attention.is_file():
        rows = read_rows(attention)
        devices |= {r["device"] for r in rows if r.get("device")}
        verdicts += judge_attention(rows, impls)
        sources.append(attention.name)
    tables = [read_rows(p) for p in sorted(folder.glob("model-*.csv"))]
    tables = [t for t in tables if t]
    for t in tables:
        devices |= {r["device"] for r in t if r.get("device")}
    verdicts += judge_training(tables, models)
    sources += [p.name for p in sorted(folder.glob("model-*.csv"))]
    if tests is not None or attention.is_file():
        verdicts.append(judge_tests(tests))
    out = [f"# issue #6's targets, from {folder} ({', '.join(sources) or 'no result files'}); "
           f"device: {', '.join(sorted(devices)) or 'not recorded'}",
           "| target | setting | measured | met? |", "|---|---|---|---|"]
    words = dict(TARGETS)
    order = {key: i for i, (key, _) in enumerate(TARGETS)}
    for v in sorted(verdicts, key=lambda v: order[v.target]):
        met = "not measured" if v.met is None else ("**yes**" if v.met else "no")
        out.append(f"| {words[v.target]} | {v.setting} | {v.figure} | {met} |")
    out += ["", *summary(verdicts)]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="the targets stage's results (attention.csv, model-*.csv)")
    ap.add_argument("--tests", type=Path, help="the GPU tests' pytest output (the check stage's gpu-tests.txt)")
    ap.add_argument("--impls", nargs="+", default=["fast-triton-all", "fast-triton"],
                    help="attention implementations to judge (rows of attention.csv; default: %(default)s)")
    ap.add_argument("--models", nargs="+", default=["nystrom", "nystrom-all", "nystrom-all-recompute"],
                    help="our models to judge (rows of model-*.csv; default: %(default)s)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        ap.error(f"{args.folder}: no such folder")
    print(report(args.folder, args.tests, args.impls, args.models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
