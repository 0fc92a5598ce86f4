"""The whole pipeline, end to end, on the embedded sample in ``demo/`` (CPU is fine; a GPU is used when present):

wikiextractor on a small MediaWiki dump → partitions → a trained byte-level BPE → shards at 128 and 512 →
pretrain a tiny Nyströmformer at 128, stopped by SIGTERM mid-epoch and resumed by the same command →
warm start at 512 with from_cp → validation → fine-tuning on a small SST-2-format task → a summary table
and a loss-curve PNG. Every step runs the real ``nystromformer`` command, as a researcher would.

    nystromformer demo --output demo-output      # or: make demo
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List

from . import atomic, jsonlog
from .atomic import check_output_folder
from .cli import add_subcommand
from .config import load_config
from .errors import UserError
from .pretrain import LOG_NAME as PRETRAIN_LOG, PREEMPTED_EXIT_CODE
from .validate import LOG_NAME as VALIDATION_LOG

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "demo"
MARKER = ".nystromformer-demo"
INTERRUPT_AT_STEP = 70  # mid-epoch: demo/tiny-128 has 40 steps per epoch


class DemoError(RuntimeError):
    pass


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def nystromformer(*args: str, check: bool = True) -> int:
    cmd = [sys.executable, "-m", "nystromformer.cli", *map(str, args)]
    print("$ nystromformer " + " ".join(map(str, args)), flush=True)
    rc = subprocess.call(cmd)
    if check and rc != 0:
        raise DemoError(f"`nystromformer {' '.join(map(str, args))}` exited with status {rc}")
    return rc


def train_steps(log: Path) -> List[int]:
    if not log.is_file():
        return []
    return [e["step"] for e in jsonlog.read(log) if e.get("type") == "train"]


def pretrain_with_interruption(model_dir: Path) -> int:
    """Start pretraining, send SIGTERM (what `docker stop` sends) mid-epoch, then rerun the same command."""
    log = model_dir / "model" / PRETRAIN_LOG
    cmd = [sys.executable, "-m", "nystromformer.cli", "pretrain", "--model-dir", str(model_dir)]
    print("$ nystromformer pretrain --model-dir " + str(model_dir) + f"   (SIGTERM at step ~{INTERRUPT_AT_STEP})", flush=True)
    proc = subprocess.Popen(cmd)
    while proc.poll() is None and len(train_steps(log)) < INTERRUPT_AT_STEP:
        time.sleep(0.05)
    if proc.poll() is not None:
        raise DemoError(f"pretraining ended (status {proc.returncode}) before it could be interrupted")
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait()
    stopped = train_steps(log)[-1]
    if rc != PREEMPTED_EXIT_CODE:
        raise DemoError(f"the interrupted run exited with status {rc}, expected {PREEMPTED_EXIT_CODE} (preempted)")
    print(f"interrupted after step {stopped}; resuming with the same command", flush=True)
    nystromformer("pretrain", "--model-dir", model_dir)
    steps = train_steps(log)
    if steps != list(range(1, len(steps) + 1)):
        raise DemoError(f"{log}: the resumed log is not one contiguous run of steps")
    return stopped


def glue_result(model_dir: Path, task_name: str) -> dict:
    """Best dev score of the demo's one fine-tuning run, beside the majority-class score on the same dev set."""
    from collections import Counter

    from .glue.tasks import get_task, read_split

    cfg = load_config(model_dir)
    (path,) = (cfg.checkpoint_dir / "glue").glob(f"{task_name}-*/result.json")
    result = json.loads(path.read_text())
    task = get_task(task_name)
    (dev_split,) = task.dev
    labels = [e.label for e in read_split(cfg.glue_dir, task, dev_split).examples]
    majority = Counter(labels).most_common(1)[0][1] / len(labels)
    return {"metric": ", ".join(result["best_metrics"]), "score": result["best_score"], "majority": majority}


def summary(out: Path, interrupted_at: int, task: str) -> str:
    vocab = json.loads((out / "data-128" / "meta.json").read_text())["vocab_size"]
    rows = ["| model | checkpoint | dev MLM loss | dev MLM accuracy | always the commonest token |",
            "|---|---|---|---|---|"]
    for name in ("tiny-128", "tiny-512"):
        for e in jsonlog.read(out / name / "model" / VALIDATION_LOG):
            rows.append(f"| {name} | {e['checkpoint']} | {e['loss']:.3f} | {e['mlm_accu']:.3f} | "
                        f"{e['commonest_token_accu']:.3f} |")
    result = glue_result(out / "tiny-128", task)
    lines = [
        "# Demo summary", "",
        f"Pretraining of tiny-128 was stopped by SIGTERM after step {interrupted_at} and resumed; tiny-512 was "
        f"warm-started from tiny-128's last checkpoint with from_cp. Chance MLM accuracy is 1/{vocab} = {1 / vocab:.4f}; "
        f"the last column is the accuracy of always predicting the commonest token of the same masked positions "
        f"(a model at that figure has learnt no more than one token).",
        "", *rows, "",
        "| fine-tuning task | metric | best dev score | majority-class dev score |", "|---|---|---|---|",
        f"| {task} (demo sample) | {result['metric']} | {result['score']:.3f} | {result['majority']:.3f} |", "",
        f"Loss curves: {out / 'loss-curves.png'}",
    ]
    return "\n".join(lines)


def check_output(out: Path) -> None:
    if out.exists() and not (out / MARKER).exists():
        raise UserError(f"{out} exists and is not a demo output folder; choose another --output")
    check_output_folder(out, "--output")


@contextlib.contextmanager
def claimed_output(out: Path) -> Iterator[None]:
    """The demo's output folder, emptied and held for this run: a lock on its marker file keeps a second demo
    from deleting this one's files while it runs (the lock goes with the process, however it ends)."""
    check_output(out)
    out.mkdir(parents=True, exist_ok=True)

    def busy(_: str) -> UserError:
        return UserError(f"--output {out}: another demo is running in this folder; wait for it to finish or choose "
                         f"another --output")
    with atomic.exclusive_lock(out / MARKER, busy,
                               "written by `nystromformer demo`; deleted and rewritten by the next demo run\n"):
        for child in out.iterdir():
            if child.name == MARKER:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        yield


def run_demo(out: Path) -> int:
    """Every step, into ``out`` (claimed by the caller: ``claimed_output``)."""
    for name in ("tiny-128", "tiny-512"):
        (out / name).mkdir()
        shutil.copy(SAMPLES / name / "config.json", out / name / "config.json")
    shutil.copytree(SAMPLES / "glue", out / "glue")
    t0 = time.time()

    banner("1/7 extract the sample Wikipedia dump with wikiextractor")
    nystromformer("extract-wiki", "--dump", SAMPLES / "sample-pages-articles.xml.bz2", "--output", out / "work" / "wiki-extracted")
    banner("2/7 documents -> plain-text partitions")
    partitions = out / "work" / "partitions" / "wiki"
    nystromformer("preprocess", "wiki", "--input", out / "work" / "wiki-extracted", "--output", partitions,
                  "--words-per-partition", "20000", "--min-words", "100")
    banner("3/7 train a byte-level BPE tokenizer on the partitions")
    nystromformer("train-tokenizer", "--input", partitions, "--output", out / "tokenizer", "--vocab-size", "2000")
    banner("4/7 token shards at 128 and 512")
    for length in (128, 512):
        # dev by runs of 8 × 510 tokens of text: the default (8,192 × 510, the paper's) exceeds this sample's size
        nystromformer("build-shards", "--seq-len", length, "--tokenizer", out / "tokenizer", "--dev-run", 8,
                      "--output", out / f"data-{length}", partitions)
    banner("5/7 pretrain a tiny Nyströmformer at 128, interrupt it, resume it")
    interrupted_at = pretrain_with_interruption(out / "tiny-128")
    banner("6/7 warm-start at 512 from the 128 checkpoint (from_cp), then validate both")
    nystromformer("pretrain", "--model-dir", out / "tiny-512")
    for name in ("tiny-128", "tiny-512"):
        nystromformer("validate", "--model-dir", out / name)
    banner("7/7 fine-tune on the sample SST-2-format task")
    task = "SST-2"
    last_epoch = load_config(out / "tiny-128").pretraining_setting.epoch - 1
    nystromformer("glue", "--model-dir", out / "tiny-128", "--task", task, "--checkpoint", last_epoch, "--batch_size", "16",
                  "--lr", "1e-3", "--epoch", "4", "--no-progress")
    nystromformer("plot", "--model-dir", out / "tiny-128", "--model-dir", out / "tiny-512",
                  "--output", out / "loss-curves.png")

    text = summary(out, interrupted_at, task)
    atomic.write_text(out / "summary.md", text + "\n")
    print("\n" + text + f"\n\nDemo finished in {time.time() - t0:.0f} s; everything is in {out}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=REPO / "demo-output", help="folder for every demo output")


def run(args: argparse.Namespace) -> int:
    out = args.output.resolve()
    with claimed_output(out):  # the user's choice of folder; past this, a failure is the demo's
        try:
            return run_demo(out)
        except (DemoError, UserError) as e:  # a step failed (its own output is above): not the user's mistake
            print(f"demo failed: {e}", file=sys.stderr)
            return 1


def add_commands(subparsers) -> None:
    add_subcommand(subparsers, "demo", "run the whole pipeline on the embedded sample", __doc__, add_arguments, run)
