"""``nystromformer glue`` and ``nystromformer glue-sweep`` (``code/run_glue.py`` is the first one).

The paper's flags are kept as it spelled them (``--batch_size --lr --epoch --task --checkpoint``); each
also has a dashed spelling.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import List, Optional

from ..cli import add_subcommand, script_main
from .finetune import FinetuneSettings, SettingsError, finetune
from .sweep import PAPER_BATCH_SIZES, PAPER_EPOCHS, PAPER_LRS, grid, run_sweep
from .tasks import TASKS


# The flags' defaults are FinetuneSettings' (one place): a run given no flag is FinetuneSettings(task, checkpoint).
DEFAULTS = {f.name: f.default for f in dataclasses.fields(FinetuneSettings)}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", "--model_dir", default=".",
                   help="model folder with config.json (default: the current directory)")
    p.add_argument("--checkpoint", type=int, required=True, help="pretraining epoch N: starts from cp-N.model")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"],
                   help=f"training seed (default {DEFAULTS['seed']}); another value adds -seed<N> to the run name")
    p.add_argument("--max_seq_len", "--max-seq-len", type=int, default=None,
                   help="truncate inputs to this many tokens (default: the model's max_seq_len)")
    p.add_argument("--warmup", type=float, default=DEFAULTS["warmup"],
                   help=f"fraction of steps warming up (default {DEFAULTS['warmup']})")
    p.add_argument("--weight-decay", "--weight_decay", type=float, default=DEFAULTS["weight_decay"])
    p.add_argument("--max-train-examples", "--max_train_examples", type=int, default=None,
                   help="train on a fixed random subset of this size (quick runs); adds -train<N> to the run name")
    p.add_argument("--max-eval-examples", "--max_eval_examples", type=int, default=None,
                   help="evaluate on a fixed random subset of each dev split (test splits stay complete)")
    p.add_argument("--eval-batch-size", "--eval_batch_size", type=int, default=DEFAULTS["eval_batch_size"])
    p.add_argument("--no-submission", dest="submission", action="store_false",
                   help="skip the test-set predictions")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")


def add_glue_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", required=True, help=f"one of {', '.join(TASKS)} (case and dash are ignored)")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--batch_size", "--batch-size", type=int, default=DEFAULTS["batch_size"])
    p.add_argument("--epoch", "--epochs", dest="epoch", type=int, default=DEFAULTS["epochs"], help="epochs to train")
    _add_common(p)


def settings_from_args(args: argparse.Namespace, **overrides) -> FinetuneSettings:
    values = dict(task=getattr(args, "task", None), checkpoint=args.checkpoint, lr=getattr(args, "lr", None),
                  batch_size=getattr(args, "batch_size", None), epochs=args.epoch, seed=args.seed,
                  max_seq_len=args.max_seq_len, warmup=args.warmup, weight_decay=args.weight_decay,
                  max_train_examples=args.max_train_examples, max_eval_examples=args.max_eval_examples,
                  submission=args.submission, eval_batch_size=args.eval_batch_size, device=args.device,
                  progress=args.progress)
    values.update(overrides)
    return FinetuneSettings(**values)


def settings_to_argv(s: FinetuneSettings) -> List[str]:
    """The ``glue`` flags that reproduce ``s`` (how the sweep hands a run to a subprocess)."""
    argv = ["--task", s.task, "--checkpoint", str(s.checkpoint), "--lr", repr(s.lr), "--batch_size",
            str(s.batch_size), "--epoch", str(s.epochs), "--seed", str(s.seed), "--warmup", repr(s.warmup),
            "--weight-decay", repr(s.weight_decay), "--eval-batch-size", str(s.eval_batch_size)]
    for flag, value in (("--max_seq_len", s.max_seq_len), ("--max-train-examples", s.max_train_examples),
                        ("--max-eval-examples", s.max_eval_examples), ("--device", s.device)):
        if value is not None:
            argv += [flag, str(value)]
    if not s.submission:
        argv.append("--no-submission")
    if not s.progress:
        argv.append("--no-progress")
    return argv


def cmd_glue(args: argparse.Namespace) -> int:
    finetune(args.model_dir, settings_from_args(args))
    return 0


def _floats(text: str) -> List[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_glue_sweep(args: argparse.Namespace) -> int:
    tasks = list(TASKS) if args.tasks.strip().lower() == "all" else [t.strip() for t in args.tasks.split(",")
                                                                     if t.strip()]
    # Given devices, even one, are honoured (each run a process that sees only its device); by default several
    # visible GPUs run in parallel, and one GPU (or none) runs the grid in this process on --device.
    # (stripped: CUDA reads " 1" as no device, and hides every device from an entry it cannot read on)
    devices = [d.strip() for d in args.devices.split(",")] if args.devices else None
    if devices and not all(devices):
        raise SettingsError(f"--devices {args.devices}: an empty entry (give CUDA_VISIBLE_DEVICES values such as 0,1)")
    if devices and args.device and ":" in args.device:
        raise SettingsError(f"--device {args.device} with --devices {args.devices}: each run sees only its own GPU "
                            f"(CUDA_VISIBLE_DEVICES), as cuda:0; --devices chooses the GPUs, so leave out --device")
    if devices is None:
        import torch
        count = torch.cuda.device_count()
        # the GPUs this process sees, named as CUDA_VISIBLE_DEVICES names them (its 2,3 are not the machine's 0,1)
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        named = visible[:count] if len(visible) >= count else [str(i) for i in range(count)]
        devices = named if count > 1 else None
    for flag, values in (("--tasks", tasks), ("--lrs", args.lrs), ("--batch-sizes", args.batch_sizes)):
        if not values:
            raise SettingsError(f"{flag}: give at least one value")
    base = settings_from_args(args, task=tasks[0], lr=args.lrs[0], batch_size=args.batch_sizes[0])
    common = {k: v for k, v in vars(base).items() if k not in ("task", "lr", "batch_size")}
    # Runs in processes of their own write their console to files (console.txt): no bars there.
    if devices:
        common["progress"] = False
    outcome = run_sweep(args.model_dir, grid(tasks, args.lrs, args.batch_sizes, **common), devices)
    summary = outcome["summary"]
    if summary["average"] is not None:
        print(f"{summary['average_label']}: {summary['average'] * 100:.2f}; see {summary['markdown']}")
    return 1 if outcome["failed"] else 0


GLUE_DOC = "Fine-tune cp-N.model of a model folder on a GLUE task; see docs/glue.md."
SWEEP_DOC = ("Fine-tune every (task, lr, batch size) of a grid and summarise the best dev scores; finished runs are "
             "skipped. See docs/glue.md.")


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", "--task", default="all",
                   help=f"comma-separated tasks, or 'all' ({', '.join(TASKS)}); default all")
    p.add_argument("--lrs", type=_floats, default=list(PAPER_LRS),
                   help="comma-separated learning rates (default 2e-5,3e-5,4e-5,5e-5)")
    p.add_argument("--batch-sizes", "--batch_sizes", type=_ints, default=list(PAPER_BATCH_SIZES),
                   help="comma-separated batch sizes (default 16,32)")
    p.add_argument("--epoch", "--epochs", dest="epoch", type=int, default=PAPER_EPOCHS)
    p.add_argument("--devices", default=None,
                   help="comma-separated CUDA_VISIBLE_DEVICES values, one parallel run each, every run a "
                        "process of its own (default: every visible GPU when there are several; with one or none, "
                        "the runs go one after another in this process on --device)")
    _add_common(p)


def add_commands(subparsers) -> None:
    add_subcommand(subparsers, "glue", "fine-tune a pretraining checkpoint on one GLUE task", GLUE_DOC,
                   add_glue_arguments, cmd_glue)
    add_subcommand(subparsers, "glue-sweep", "the paper's GLUE grid (lr x batch size) with a summary", SWEEP_DOC,
                   add_sweep_arguments, cmd_glue_sweep)


def main(argv: Optional[List[str]] = None) -> int:
    """``run_glue.py``: the ``glue`` command on its own."""
    return script_main("run_glue.py", GLUE_DOC + " (Same as `nystromformer glue`.)", add_glue_arguments, cmd_glue,
                       argv)
