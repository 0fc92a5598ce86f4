"""The paper's GLUE grid: every (task, lr, batch size) run, then a summary of the best dev scores.

Runs go one per GPU in parallel when several devices are given (each a subprocess of
``run_glue.py`` (= ``nystromformer glue``) with its own CUDA_VISIBLE_DEVICES), and one after another in this process
otherwise. A run with a result.json is finished and skipped, so an interrupted sweep resumes where it
stopped. The summary (CSV, Markdown, PNG) goes to ``<checkpoint_dir>/glue/sweep-<checkpoint>/``.
"""
from __future__ import annotations

import csv
import io
import os
import queue
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from .. import atomic
from ..config import load_config
from .finetune import FinetuneSettings, SettingsError, finetune, read_result, run_dir
from .tasks import TASKS

PAPER_LRS = (2e-5, 3e-5, 4e-5, 5e-5)
PAPER_BATCH_SIZES = (16, 32)
PAPER_EPOCHS = 5
CODE_DIR = Path(__file__).resolve().parents[2]   # the folder holding the nystromformer package


def grid(tasks: Sequence[str], lrs: Sequence[float], batch_sizes: Sequence[int], **common) -> List[FinetuneSettings]:
    """One FinetuneSettings per (task, lr, batch size); ``common`` sets the rest (checkpoint, epochs...)."""
    return [FinetuneSettings(task=t, lr=lr, batch_size=bs, **common) for t in tasks for lr in lrs for bs in batch_sizes]


def summary_dir(checkpoint_dir: Path, checkpoint: int) -> Path:
    return Path(checkpoint_dir) / "glue" / f"sweep-{checkpoint}"


def _run_subprocess(model_dir: Path, settings: FinetuneSettings, device: str, checkpoint_dir: Path) -> int:
    from .commands import settings_to_argv

    out = run_dir(checkpoint_dir, settings)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=device,
               PYTHONPATH=os.pathsep.join(filter(None, [str(CODE_DIR), os.environ.get("PYTHONPATH")])))
    # run_glue.py is `nystromformer glue` without importing every other subcommand's module.
    cmd = [sys.executable, str(CODE_DIR / "run_glue.py"), "--model-dir", str(model_dir),
           *settings_to_argv(settings), "--no-progress"]
    # The console output of the latest attempt (rewritten each time); result.json marks completion.
    with open(out / "console.txt", "w") as console:
        return subprocess.run(cmd, env=env, stdout=console, stderr=subprocess.STDOUT).returncode


def run_sweep(model_dir: Union[str, Path], runs: List[FinetuneSettings], devices: Optional[List[str]] = None,
              log: Callable[[str], None] = print) -> dict:
    """Run every unfinished run, then write the summary. ``devices``: CUDA_VISIBLE_DEVICES values, one
    worker each (parallel); None or a single device runs sequentially in this process.
    Returns {"summary": write_summary(...), "ran": [...], "skipped": [...], "failed": [...]} (run names)."""
    model_dir = Path(model_dir)
    checkpoint_dir = load_config(model_dir).checkpoint_dir
    pending = [s for s in runs if read_result(checkpoint_dir, s) is None]
    skipped = [s.run_name for s in runs if s not in pending]
    if skipped:
        log(f"skipping {len(skipped)} finished run(s): {', '.join(skipped)}")
    failed: List[str] = []

    if devices and len(devices) > 1:
        log(f"running {len(pending)} run(s) on devices {', '.join(devices)}, one per device")
        free = queue.Queue()
        for d in devices:
            free.put(d)

        def work(settings: FinetuneSettings) -> None:
            device = free.get()
            try:
                log(f"start {settings.run_name} on CUDA_VISIBLE_DEVICES={device}")
                code = _run_subprocess(model_dir, settings, device, checkpoint_dir)
                if code != 0:
                    failed.append(settings.run_name)
                    log(f"FAILED {settings.run_name} (exit {code}); see {run_dir(checkpoint_dir, settings) / 'console.txt'}")
            finally:
                free.put(device)

        with ThreadPoolExecutor(max_workers=len(devices)) as pool:
            list(pool.map(work, pending))
    else:
        for i, settings in enumerate(pending, 1):
            log(f"run {i}/{len(pending)}: {settings.run_name}")
            try:
                finetune(model_dir, settings, log=log)
            except Exception as e:  # one bad run (e.g. a task's data missing) must not stop the grid
                failed.append(settings.run_name)
                log(f"FAILED {settings.run_name}: {type(e).__name__}: {e}")

    summary = write_summary(checkpoint_dir, runs, log=log)
    return {"summary": summary, "ran": [s.run_name for s in pending if s.run_name not in failed],
            "skipped": skipped, "failed": failed}


def write_summary(checkpoint_dir: Path, runs: List[FinetuneSettings], log: Callable[[str], None] = print) -> dict:
    """summary.csv (one row per finished configuration), summary.md (that table, the best configuration of
    each task and the GLUE average of those) and dev_scores.png (dev score per epoch)."""
    if not runs:
        raise SettingsError("the sweep has no runs (no tasks, learning rates or batch sizes given)")
    results = [(s, r) for s in runs if (r := read_result(checkpoint_dir, s)) is not None]
    checkpoints = sorted({s.checkpoint for s in runs})
    out = summary_dir(checkpoint_dir, checkpoints[0] if len(checkpoints) == 1 else "mixed")
    metric_names = sorted({m for _, r in results for m in r["best_metrics"]})
    rows = [{"task": s.task, "checkpoint": s.checkpoint, "lr": f"{s.lr:g}", "batch_size": s.batch_size,
             "epochs": s.epochs, "best_epoch": r["best_epoch"], "score": round(r["best_score"], 6),
             **{m: round(r["best_metrics"][m], 6) for m in metric_names if m in r["best_metrics"]}}
            for s, r in results]

    best_per_task: Dict[str, dict] = {}
    for row in rows:
        if row["task"] not in best_per_task or row["score"] > best_per_task[row["task"]]["score"]:
            best_per_task[row["task"]] = row
    # Tasks in GLUE's order; the average is over the tasks this sweep covered.
    best_per_task = {t: best_per_task[t] for t in TASKS if t in best_per_task}
    glue_average = float(np.mean([r["score"] for r in best_per_task.values()])) if best_per_task else None

    columns = ["task", "checkpoint", "lr", "batch_size", "epochs", "best_epoch", "score", *metric_names]
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

    md = ["# GLUE sweep", "", f"Dev scores ×100 of {len(rows)} finished run(s) of {len(runs)}. "
          "score = mean of the task's metrics.", "", "## Best configuration per task", "",
          *table(list(best_per_task.values())), ""]
    if glue_average is not None:
        md += [f"**GLUE average** (best per task, over {', '.join(best_per_task)}): {glue_average * 100:.2f}", ""]
    md += ["## All configurations", "", *table(rows), ""]
    atomic.write_text(out / "summary.md", "\n".join(md))

    plot = _plot_dev_scores(results, out / "dev_scores.png") if results else None
    log(f"sweep summary: {len(rows)}/{len(runs)} runs finished; written to {out}")
    return {"dir": str(out), "csv": str(out / "summary.csv"), "markdown": str(out / "summary.md"),
            "plot": plot, "rows": rows, "best_per_task": best_per_task, "glue_average": glue_average}


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
        ax.legend(fontsize="small")
    fig.tight_layout()
    with atomic.atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return str(path)
