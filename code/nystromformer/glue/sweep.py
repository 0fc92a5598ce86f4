"""The paper's GLUE grid: every (task, lr, batch size) run, then a summary of the best dev scores.

Runs go one per GPU in parallel when several devices are given (each a subprocess of
``run_glue.py`` (= ``nystromformer glue``) with its own CUDA_VISIBLE_DEVICES), and one after another in this process
otherwise. A finished run is skipped (a result.json with the same settings, no failed submission and no missing
submission file whose test file has appeared since: ``finetune.is_finished``), so an interrupted sweep resumes
where it stopped. The summary (CSV, Markdown, PNG) goes to ``<checkpoint_dir>/glue/sweep-<checkpoint>[<suffix>]/`` and
covers every finished run in ``<checkpoint_dir>/glue/`` made with this sweep's settings bar task, lr and batch size,
not only this sweep's grid (the suffix: ``-seed<N>``/``-train<N>`` as in the run names, so runs with another seed or
training subset get their own summary; runs differing in epochs, warm-up, sequence length... are left out, with a
warning).
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from .. import atomic
from ..checkpoint import find_model
from ..cli import say
from ..config import load_config
from ..errors import UserError
from ..runtime import check_environment, resolve_device
from .finetune import (PADDED_TO_LONGEST, PRESENTATION_SETTINGS, WITH_ITS_BATCH, FinetuneSettings, SettingsError,
                       check_max_seq_len, check_task_folder, finetune, is_finished, method_differences, method_of,
                       read_result, run_dir, with_model_length)
from .metrics import better_score
from .tasks import TASKS, GlueDataError, get_task, submission_file_names

PAPER_LRS = (2e-5, 3e-5, 4e-5, 5e-5)
PAPER_BATCH_SIZES = (16, 32)
PAPER_EPOCHS = 5
CODE_DIR = Path(__file__).resolve().parents[2]   # the folder holding the nystromformer package


def grid(tasks: Sequence[str], lrs: Sequence[float], batch_sizes: Sequence[int], **common) -> List[FinetuneSettings]:
    """One FinetuneSettings per (task, lr, batch size); ``common`` sets the rest (checkpoint, epochs...). A run
    named twice (``WNLI,wnli``, ``1e-3,0.001``) is run once: two copies would write one folder."""
    unique: Dict[str, FinetuneSettings] = {}
    for s in (FinetuneSettings(task=t, lr=lr, batch_size=bs, **common)
              for t in tasks for lr in lrs for bs in batch_sizes):
        if s.run_name in unique and unique[s.run_name] != s:  # e.g. 1e-5 and 1.0000001e-5: one folder, two runs
            raise SettingsError(f"the grid's runs {unique[s.run_name]} and {s} would share the run name "
                                f"{s.run_name}; give values that differ in their names")
        unique.setdefault(s.run_name, s)
    return list(unique.values())


def summary_dir(checkpoint_dir: Path, settings: FinetuneSettings) -> Path:
    """``glue/sweep-<checkpoint>`` (+ the runs' seed / subset suffix); sweeps with other settings that change
    scores (epochs, warmup, max_seq_len...) get a hash of them too, so that they do not overwrite each other's
    summary (its summary.md lists the settings)."""
    default = shared_settings(FinetuneSettings(task=settings.task, checkpoint=settings.checkpoint,
                                               seed=settings.seed, max_train_examples=settings.max_train_examples))
    differ = {k: v for k, v in shared_settings(settings).items() if default[k] != v}
    tag = "-" + hashlib.sha1(json.dumps(differ, sort_keys=True).encode()).hexdigest()[:8] if differ else ""
    return Path(checkpoint_dir) / "glue" / f"sweep-{settings.checkpoint}{settings.run_suffix}{tag}"


# What a sweep varies. Its runs share every other setting that changes a dev score, and a summary compares only
# runs that share them too (submission: whether test predictions are written; no dev score changes with it).
GRID_AXES = ("task", "lr", "batch_size")
NOT_COMPARED = {*GRID_AXES, *PRESENTATION_SETTINGS}


def shared_settings(settings: FinetuneSettings) -> dict:
    """The settings a summary's runs must agree on (checkpoint, seed, epochs, max_seq_len, warmup...)."""
    return {k: v for k, v in dataclasses.asdict(settings).items() if k not in NOT_COMPARED}


def _summary_key(settings: FinetuneSettings) -> tuple:
    """Which summary folder a run belongs to (see summary_dir)."""
    return settings.checkpoint, settings.seed, settings.max_train_examples


class _Runs:
    """The sweep's run subprocesses: started under a lock that stopping takes too, so none starts after a stop."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stopped = False
        self.running: set = set()

    def start(self, cmd: List[str], **popen) -> Optional[subprocess.Popen]:
        with self.lock:
            if self.stopped:
                return None
            child = subprocess.Popen(cmd, **popen)
            self.running.add(child)
            return child

    def finished(self, child: subprocess.Popen) -> None:
        with self.lock:
            self.running.discard(child)

    def stop(self) -> int:
        """Start no more and terminate the running ones; returns how many were running."""
        with self.lock:
            self.stopped = True
            running = list(self.running)
        for child in running:
            child.terminate()
        return len(running)


def _run_subprocess(model_dir: Path, settings: FinetuneSettings, device: str, checkpoint_dir: Path,
                    runs: _Runs) -> Optional[int]:
    """The run's exit status, or None when the sweep was stopped before it started."""
    from .commands import settings_to_argv

    out = run_dir(checkpoint_dir, settings)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=device,
               PYTHONPATH=os.pathsep.join(filter(None, [str(CODE_DIR), os.environ.get("PYTHONPATH")])))
    # run_glue.py is `nystromformer glue` without importing every other subcommand's module.
    cmd = [sys.executable, str(CODE_DIR / "run_glue.py"), "--model-dir", str(model_dir),
           *settings_to_argv(dataclasses.replace(settings, progress=False))]  # the console goes to a file
    # Each attempt's console output, appended under a line of its own: an attempt refused by a run still going
    # (run.lock) must not wipe that run's output. result.json marks completion.
    with open(out / "console.txt", "a") as console:
        console.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd[1:])} (CUDA_VISIBLE_DEVICES={device})\n")
        console.flush()
        child = runs.start(cmd, env=env, stdout=console, stderr=subprocess.STDOUT)
        if child is None:
            return None
        try:
            return child.wait()
        finally:
            runs.finished(child)


def _stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def run_sweep(model_dir: Union[str, Path], runs: List[FinetuneSettings], devices: Optional[List[str]] = None,
              log: Callable[[str], None] = say) -> dict:
    """Run every unfinished run, then write the summary. ``devices``: CUDA_VISIBLE_DEVICES values, one worker
    each, every run in a process of its own that sees only its device (a single value: one run at a time on that
    device); None runs them one after another in this process, on ``--device``.
    Returns {"summary": write_summary(...), "ran": [...], "skipped": [...], "failed": [...]} (run names)."""
    model_dir = Path(model_dir)
    if not runs:
        raise SettingsError("the sweep has no runs (no tasks, learning rates or batch sizes given)")
    if any(shared_settings(s) != shared_settings(runs[0]) for s in runs):
        raise SettingsError(f"a sweep's runs must share every setting but {', '.join(GRID_AXES)} (its summary "
                            f"compares runs made alike); run one sweep per combination")
    cfg = load_config(model_dir)
    runs = [with_model_length(s, cfg) for s in runs]
    checkpoint_dir, glue_dir = cfg.checkpoint_dir, cfg.glue_dir
    method = method_of(cfg.model)
    pending = [s for s in runs if not is_finished(read_result(checkpoint_dir, s, method), glue_dir, s.submission)]
    skipped = [s.run_name for s in runs if s not in pending]
    if skipped:
        log(f"skipping {len(skipped)} finished run(s): {', '.join(skipped)}")
    if pending:  # what would fail every run fails the sweep once, before the first (a finished one needs neither)
        check_environment()  # a misspelt NYSTROM_* would fail each run in turn
        if runs[0].device is not None:
            resolve_device(runs[0].device)
        # each run would quietly train on the CPU instead (CUDA_VISIBLE_DEVICES="" asks for that: the API's CPU pool)
        # (unless CUDA_VISIBLE_DEVICES hides the GPUs from this process only: the runs get devices of their own)
        if (devices and any(devices) and not torch.cuda.is_available()
                and os.environ.get("CUDA_VISIBLE_DEVICES") is None):
            raise SettingsError(f"--devices {','.join(devices)}: PyTorch sees no CUDA GPU here (torch "
                                f"{torch.__version__}); leave --devices out to run the sweep on the CPU")
        find_model(checkpoint_dir, runs[0].checkpoint)
        check_max_seq_len(cfg, runs[0].max_seq_len)
        atomic.check_writable_folder(Path(checkpoint_dir) / "glue", "the sweep's runs")
        missing = []  # every task whose folder is missing, named at once (not one fix and rerun per task)
        for task in dict.fromkeys(s.task for s in pending):
            try:
                check_task_folder(cfg, get_task(task))
            except GlueDataError as e:
                missing.append((task, e))
        if len(missing) == 1:
            raise GlueDataError(f"{missing[0][1]}; or leave {missing[0][0]} out of --tasks")
        if missing:
            folders = ", ".join(f"{get_task(t).folder}/" for t, _ in missing)
            raise GlueDataError(f"{cfg.config_file}: glue_dataset_folder: no {folders} in {cfg.glue_dir} (the GLUE "
                                f"data folder, with one folder per task); or leave "
                                f"{', '.join(t for t, _ in missing)} out of --tasks")
    failed: List[str] = []

    if devices:
        log(f"running {len(pending)} run(s) on CUDA_VISIBLE_DEVICES {', '.join(devices)}, one per device at a time")
        free = queue.Queue()
        for d in devices:
            free.put(d)
        runs_in_flight = _Runs()

        def work(settings: FinetuneSettings) -> None:
            device = free.get()
            try:
                if runs_in_flight.stopped:
                    return
                log(f"start {settings.run_name} on CUDA_VISIBLE_DEVICES={device}")
                code = _run_subprocess(model_dir, settings, device, checkpoint_dir, runs_in_flight)
                if code is not None and code != 0:
                    failed.append(settings.run_name)
                    console = run_dir(checkpoint_dir, settings) / "console.txt"
                    if runs_in_flight.stopped:
                        log(f"stopped {settings.run_name} (exit {code})")
                    else:
                        log(f"FAILED {settings.run_name} (exit {code}); see {console}")
            finally:
                free.put(device)

        # Ctrl-C or SIGTERM (docker stop, a scheduler) stops the runs in flight and starts no more: orphaned
        # workers would go on writing the run folders a rerun starts again.
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _stop_on_sigterm) if in_main_thread else None
        pool = ThreadPoolExecutor(max_workers=len(devices))
        try:
            list(pool.map(work, pending))
        except BaseException:
            stopped = runs_in_flight.stop()
            log(f"stopped: {stopped} run(s) in flight terminated; rerun the sweep to redo them")
            raise
        finally:
            try:
                pool.shutdown(wait=True, cancel_futures=True)
            finally:
                if in_main_thread:
                    signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    else:
        for i, settings in enumerate(pending, 1):
            log(f"run {i}/{len(pending)}: {settings.run_name}")
            try:
                finetune(model_dir, settings, log=log)
            except Exception as e:  # one bad run (e.g. a task's data missing) must not stop the grid
                failed.append(settings.run_name)
                if isinstance(e, UserError):
                    log(f"FAILED {settings.run_name}: {e}")
                else:  # not a user's mistake: the traceback, as a subprocess run's console.txt would keep it
                    log(f"FAILED {settings.run_name}: {type(e).__name__}: {e}\n{traceback.format_exc().rstrip()}")

    summary = write_summary(checkpoint_dir, runs, log=log, glue_dir=glue_dir, method=method)
    return {"summary": summary, "ran": [s.run_name for s in pending if s.run_name not in failed],
            "skipped": skipped, "failed": failed}


def finished_runs(checkpoint_dir: Path, like: FinetuneSettings, log: Callable[[str], None] = say,
                  method: Optional[dict] = None) -> List[tuple]:
    """(settings, result) of every run in ``<checkpoint_dir>/glue/`` whose training completed with ``like``'s
    shared settings (see ``shared_settings``), in GLUE's task order, then by lr and batch size. Finished runs of the
    same summary folder (checkpoint, seed, training subset) made with other settings are left out, with a
    warning: their scores are not comparable (a longer schedule, other sequence lengths or dev subsets...); so are,
    given ``method`` (``method_of``), runs whose batches were padded or evaluated otherwise."""
    found, others, made_otherwise = [], [], {}
    wanted = shared_settings(like)
    for path in sorted((Path(checkpoint_dir) / "glue").glob("*/result.json")):
        try:
            result = json.loads(path.read_text())
            settings = FinetuneSettings(**result["settings"])
        except (ValueError, TypeError, KeyError) as e:  # not silently: the summary would miss it
            log(f"warning: {path} is unreadable ({type(e).__name__}: {e}); not in the summary")
            continue
        if _summary_key(settings) != _summary_key(like):
            continue  # another summary folder's run
        if path.parent.name != settings.run_name:  # e.g. seed 7 run by a version without -seed7 in its names
            log(f"warning: {path.parent} holds run {settings.run_name}; not in the summary (rename the folder to "
                f"{settings.run_name} to include it)")
            continue
        if shared_settings(settings) != wanted:
            others.append(settings)
            continue
        differences = method_differences(method, result)
        if differences:
            made_otherwise.setdefault(", ".join(differences), []).append(settings.run_name)
            continue
        found.append((settings, result))
    for differences, names in made_otherwise.items():
        why = (f": runs before 2026-11-23 padded their batches {PADDED_TO_LONGEST}, before 2026-11-24 evaluated "
               f"each example {WITH_ITS_BATCH}; a Nystrom model's predictions then depended on their batch: "
               f"docs/glue.md, 'Padding'" if "batches padded" in differences or "examples evaluated" in differences
               else ": config.json's model settings changed since they ran")
        log(f"warning: {len(names)} finished run(s) in {Path(checkpoint_dir) / 'glue'} were made otherwise than this "
            f"model's runs must be ({differences}{why}) and are not in the summary: {', '.join(names)}; rerun the "
            f"sweep to redo them")
    if others:
        theirs: Dict[str, set] = {}
        for s in others:
            for k, v in shared_settings(s).items():
                if v != wanted[k]:
                    theirs.setdefault(k, set()).add(str(v))
        values = "; ".join(f"{k} {', '.join(sorted(theirs[k]))} instead of {wanted[k]}" for k in sorted(theirs))
        log(f"warning: {len(others)} finished run(s) in {Path(checkpoint_dir) / 'glue'} made with other settings "
            f"({values}) are not in the summary, which compares runs made alike; rerun the sweep with their "
            f"settings to summarise them")
    order = {t: i for i, t in enumerate(TASKS)}
    return sorted(found, key=lambda sr: (order.get(sr[0].task, len(order)), sr[0].lr, sr[0].batch_size))


def write_summary(checkpoint_dir: Path, runs: List[FinetuneSettings], log: Callable[[str], None] = say,
                  glue_dir: Optional[Path] = None, method: Optional[dict] = None) -> dict:
    """summary.csv (one row per finished run made with the sweep's shared settings, whichever sweep ran it),
    summary.md (that table, the best configuration of each task and the average of those), dev_scores.png
    (dev score per epoch) and submission/ (the best run's test predictions of each task, the leaderboard's files).
    The average is the GLUE average only when it covers every GLUE task; ``average_tasks`` says which it covers."""
    if not runs:
        raise SettingsError("the sweep has no runs (no tasks, learning rates or batch sizes given)")
    results = finished_runs(checkpoint_dir, runs[0], log, method)
    out = summary_dir(checkpoint_dir, runs[0])
    metric_names = sorted({m for _, r in results for m in r["best_metrics"]})
    rows = [{"task": s.task, "checkpoint": s.checkpoint, "lr": f"{s.lr:g}", "batch_size": s.batch_size,
             "epochs": s.epochs, "best_epoch": r["best_epoch"], "score": round(r["best_score"], 6),
             **{m: round(r["best_metrics"][m], 6) for m in metric_names if m in r["best_metrics"]},
             "run": s.run_name, "submission": " ".join(submission_files(checkpoint_dir, s, r))}
            for s, r in results]

    best_per_task: Dict[str, dict] = {}
    for row in rows:
        if row["task"] not in best_per_task or better_score(row["score"], best_per_task[row["task"]]["score"]):
            best_per_task[row["task"]] = row
    # Tasks in GLUE's order; the average is over the tasks with a finished run whose best score is a number (a
    # task whose every run diverged has NaN as its best: left out and named, or the average would be NaN).
    best_per_task = {t: best_per_task[t] for t in TASKS if t in best_per_task}
    scored = [t for t, r in best_per_task.items() if math.isfinite(r["score"])]
    diverged_tasks = [t for t in best_per_task if t not in scored]
    average = float(np.mean([best_per_task[t]["score"] for t in scored])) if scored else None
    complete = len(scored) == len(TASKS)
    average_label = average_description(scored) + (f"; left out, every run diverged: {', '.join(diverged_tasks)}"
                                                   if diverged_tasks else "")

    columns = ["task", "checkpoint", "lr", "batch_size", "epochs", "best_epoch", "score", *metric_names, "run",
               "submission"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic.write_text(out / "summary.csv", buf.getvalue())

    def table(table_rows: List[dict]) -> List[str]:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in table_rows:
            cells = [f"{row[c] * 100:.2f}" if c == "score" or c in metric_names and c in row else str(row.get(c, ""))
                     for c in columns]
            lines.append("| " + " | ".join(cells) + " |")
        return lines

    shared = shared_settings(runs[0])
    described = {k: ("the model's" if k == "max_seq_len" and v is None else
                     "all" if k in ("max_train_examples", "max_eval_examples") and v is None else v)
                 for k, v in shared.items()}
    md = ["# GLUE sweep", "", f"Dev scores ×100 of the {len(rows)} finished run(s) of checkpoint "
          f"{runs[0].checkpoint} in {Path(checkpoint_dir) / 'glue'} made with "
          f"{', '.join(f'{k}={v}' for k, v in described.items())}. score = mean of the task's metrics.", "",
          "## Best configuration per task", "",
          *table(list(best_per_task.values())), ""]
    if average is not None:
        md += [f"**{average_label}**: {average * 100:.2f}", ""]
    elif diverged_tasks:
        md += [f"No average: every run of {', '.join(diverged_tasks)} diverged.", ""]
    md += ["## All configurations", "", *table(rows), ""]
    md += collect_submission(checkpoint_dir, results, best_per_task, out / "submission")
    atomic.write_text(out / "summary.md", "\n".join(md))

    plot = _plot_dev_scores(results, out / "dev_scores.png") if results else None
    unfinished = sum(not is_finished(read_result(checkpoint_dir, s, method), glue_dir, s.submission) for s in runs)
    state = (f"all {len(runs)} of this sweep's runs are finished" if not unfinished else
             f"{unfinished} of this sweep's {len(runs)} runs are not finished: rerun the sweep to complete them")
    log(f"sweep summary of {len(rows)} finished run(s) written to {out}; {state}")
    return {"dir": str(out), "csv": str(out / "summary.csv"), "markdown": str(out / "summary.md"),
            "plot": plot, "rows": rows, "settings": shared, "best_per_task": best_per_task, "average": average,
            "average_tasks": scored, "diverged_tasks": diverged_tasks, "average_label": average_label,
            "glue_average": average if complete else None}


def submission_files(checkpoint_dir: Path, settings: FinetuneSettings, result: dict) -> Dict[str, Path]:
    """The run's submission files that exist, by name; found in its run folder (result.json's paths are relative to
    wherever that run was started)."""
    folder = run_dir(checkpoint_dir, settings) / "submission"
    names = [Path(f).name for f in result.get("submission", [])]
    return {name: folder / name for name in names if (folder / name).is_file()}


def collect_submission(checkpoint_dir: Path, results: List[tuple], best_per_task: Dict[str, dict],
                       folder: Path) -> List[str]:
    """Copy the best run's submission files of each task into ``folder`` (files of runs no longer best are
    removed) and return summary.md's section saying which of the leaderboard's files are there and why others
    are not."""
    by_run = {s.run_name: (s, r) for s, r in results}
    lines, lacking = [], []
    for task in TASKS.values():
        best = best_per_task.get(task.name)
        settings, result = by_run[best["run"]] if best else (None, {})
        produced = submission_files(checkpoint_dir, settings, result) if best else {}
        for name in submission_file_names(task):
            target = folder / name
            if name in produced:
                atomic.write_text(target, produced[name].read_text())
                continue
            target.unlink(missing_ok=True)
            if best is None:
                lacking.append(f"{name} (no finished {task.name} run)")
            else:
                if not settings.submission:
                    why = "made with --no-submission"
                elif name in result.get("submission_missing", []):
                    why = "its test file was absent; rerun it once the file is there"
                elif result.get("diverged"):
                    why = "diverged, no submission"
                else:
                    why = "its test file could not be used: see submission_errors in its result.json"
                lacking.append(f"{name} ({task.name}'s best run {best['run']}: {why})")
    total = sum(len(submission_file_names(t)) for t in TASKS.values())
    lines += ["## Leaderboard submission", "",
              f"{folder}: the best run's test predictions of each task, {total - len(lacking)} of the {total} files "
              f"gluebenchmark.com expects in one zip" + (":" if lacking else " (zip them: `cd submission && zip "
                                                                              "../submission.zip *.tsv`)."), ""]
    lines += [f"* missing {item}" for item in lacking] + ([""] if lacking else [])
    return lines


def average_description(tasks: List[str]) -> str:
    """How to call the mean of the best score per task: the GLUE average only over all nine tasks."""
    if len(tasks) == len(TASKS):
        return f"GLUE average (best per task, all {len(TASKS)} tasks)"
    return (f"Average of the best per task over {', '.join(tasks)} ({len(tasks)} of {len(TASKS)} GLUE tasks; "
            f"not the GLUE average)")


def _plot_dev_scores(results, path: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if any(s.task == t for s, _ in results)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for s, r in results:
            if s.task == task:
                epochs = [h["epoch"] for h in r["history"]]
                ax.plot(epochs, [h["score"] for h in r["history"]], marker="o", label=f"lr {s.lr:g}, bs {s.batch_size}")
        ax.set(title=task, xlabel="epoch", ylabel="dev score")
        # the epochs themselves as ticks (whole numbers: a 1-epoch sweep got 0.96 ... 1.04)
        ax.set_xticks(sorted({h["epoch"] for s, r in results if s.task == task for h in r["history"]}))
        ax.legend(fontsize="small")
    fig.tight_layout()
    with atomic.atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return str(path)
