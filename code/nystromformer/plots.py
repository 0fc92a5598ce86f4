"""Loss curves from pretraining logs (``pretrain_output.log``: one JSON object per line).

    nystromformer plot --model-dir nystrom-512 --model-dir nystrom-4096 --output curves.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from . import atomic, jsonlog
from .atomic import check_output_folder, check_writable_folder
from .cli import add_subcommand
from .config import load_config
from .errors import UserError
from .pretrain import LOG_NAME


def plot_pretraining(logs: Dict[str, Path], output: Path) -> Path:
    """Train loss (smoothed) and dev loss / MLM accuracy against step, one colour per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for (label, path), colour in zip(logs.items(), run_colours(len(logs))):
        train, dev = plotted_entries(path)
        if train:
            steps, losses = [e["step"] for e in train], [e["loss"] for e in train]
            window = max(1, len(losses) // 50)
            smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
                      for i in range(len(losses))]
            ax_loss.plot(steps, smooth, color=colour, label=f"{label} train")
            ax_acc.plot(steps, [e["mlm_accu"] for e in train], color=colour, alpha=0.3)
        if dev:
            ax_loss.plot([e["step"] for e in dev], [e["loss"] for e in dev], "o--", color=colour, label=f"{label} dev")
            ax_acc.plot([e["step"] for e in dev], [e["mlm_accu"] for e in dev], "o--", color=colour,
                        label=f"{label} dev")
    ax_loss.set(xlabel="step", ylabel="MLM loss", title="MLM loss")
    ax_acc.set(xlabel="step", ylabel="MLM accuracy", title="MLM accuracy (dev: points)")
    for axes in (ax_loss, ax_acc):
        if axes.get_legend_handles_labels()[0]:  # (the accuracy panel has none for logs without dev points)
            axes.legend()
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_open(output, "wb") as f:
        fig.savefig(f, format=output.suffix.lstrip(".").lower() or "png", dpi=100)  # as savefig(path) infers
    plt.close(fig)
    return output


def run_colours(count: int) -> list:
    """One colour per run: matplotlib's default cycle (10 colours), else evenly spaced along a colormap — a zip
    with the cycle alone left every run after the tenth out of the figure."""
    import matplotlib.pyplot as plt
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if count <= len(cycle):
        return cycle[:count]
    colormap = plt.get_cmap("turbo")
    return [colormap(i / (count - 1)) for i in range(count)]


PLOTTED_KEYS = ("step", "loss", "mlm_accu")


def plotted_entries(path: Path) -> Tuple[List[dict], List[dict]]:
    """The log's train and dev points; entries that lack a plotted number are counted in a warning."""
    points: Dict[str, List[dict]] = {"train": [], "dev": []}
    unusable = 0
    for entry in jsonlog.read(path):
        if entry.get("type") in points:
            if all(isinstance(entry.get(k), (int, float)) for k in PLOTTED_KEYS):
                points[entry["type"]].append(entry)
            else:
                unusable += 1
    if unusable:
        print(f"warning: {path}: {unusable} train/dev entr{'y' if unusable == 1 else 'ies'} without "
              f"{', '.join(PLOTTED_KEYS)} left out", file=sys.stderr)
    if not points["train"] and not points["dev"]:
        raise UserError(f"{path}: no train or dev entry to plot")
    return points["train"], points["dev"]


def check_output(output: Path) -> None:
    from matplotlib.figure import Figure
    formats = sorted("." + f for f in Figure().canvas.get_supported_filetypes())
    if output.suffix.lower() not in formats or output.is_dir():
        raise UserError(f"--output {output}: give an image file name ending in one of {', '.join(formats)}")
    if not output.is_file():  # (an existing image is replaced) its folders can be made
        check_output_folder(output, "--output")
    check_writable_folder(output.parent, "--output")  # else the write names its hidden temporary file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", action="append", required=True, help="model folder (repeatable)")
    parser.add_argument("--output", required=True, type=Path, help="PNG file to write")


def run_labels(folders: List[str]) -> Dict[str, Path]:
    """Model folders keyed by the shortest trailing part of their path that tells them apart
    (``a/run`` and ``b/run``, not two ``run``s drawn as one)."""
    paths = [Path(f).resolve() for f in folders]
    if len(set(paths)) < len(paths):
        twice = next(str(p) for p in paths if paths.count(p) > 1)
        raise UserError(f"--model-dir {twice} is given more than once")
    labels = {}
    for path in paths:
        for k in range(1, len(path.parts) + 1):
            label = "/".join(path.parts[-k:])
            if not any(other != path and other.parts[-k:] == path.parts[-k:] for other in paths):
                break
        labels[label] = path
    return labels


def run(args: argparse.Namespace) -> int:
    check_output(args.output)
    logs = {}
    for label, folder in run_labels(args.model_dir).items():
        path = load_config(folder).checkpoint_dir / LOG_NAME
        if not path.is_file():
            raise UserError(f"{path} does not exist (has {folder} been pretrained?)")
        logs[label] = path
    print(f"wrote {plot_pretraining(logs, args.output)}")
    return 0


def add_commands(subparsers) -> None:
    add_subcommand(subparsers, "plot", "plot pretraining loss and MLM accuracy curves", __doc__, add_arguments, run)
