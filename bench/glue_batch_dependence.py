"""How much a fine-tuned model's dev predictions depend on the batch they are predicted in.

Predicts a GLUE dev split with the weights of one finished `glue` run at several eval batch sizes, with batches
padded to their longest example ("longest", what GLUE fine-tuning did for every attention before 2026-11-23) and
to --max-seq-len ("fixed", what it does now for attention whose outputs depend on the amount of padding), and
prints one table: the dev metrics and how many predictions differ from those at batch size 1. Predictions go
through `Runner.predict`, which since 2026-11-24 takes Nystrom's "original" init per example: the "fixed" rows
then agree at every batch size (before, the init's batch-wide maximum moved them). Batch size 1 is the baseline
of every comparison: it is predicted first whether or not --batch-sizes lists it.

    python bench/glue_batch_dependence.py --model-dir MODEL --run SST-2-0-0.001-32-2 --task SST-2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "code"))
from nystromformer.checkpoint import load as load_checkpoint  # noqa: E402
from nystromformer.config import as_recorded, config_from_dict, load_config  # noqa: E402
from nystromformer.glue.encoding import EncodedDataset, PadCollator  # noqa: E402
from nystromformer.glue.finetune import Runner  # noqa: E402
from nystromformer.glue.metrics import split_metrics  # noqa: E402
from nystromformer.glue.tasks import get_task, read_split  # noqa: E402
from nystromformer.model import NystromformerForSequenceClassification  # noqa: E402
from nystromformer.tokenizer import load_model_tokenizer  # noqa: E402


def batch_sizes(text: str) -> list:
    """--batch-sizes as a list, batch size 1 (the baseline) first and each size once; ValueError for a bad entry."""
    sizes = []
    for entry in text.split(","):
        if not entry.strip().isdigit() or int(entry) < 1:
            raise ValueError(f"{entry!r} is not a positive integer")
        sizes.append(int(entry))
    return list(dict.fromkeys([1, *sizes]))


def validate_args(ap, args) -> None:
    try:
        batch_sizes(args.batch_sizes)
    except ValueError as error:
        ap.error(f"--batch-sizes {args.batch_sizes}: {error} (comma-separated eval batch sizes, e.g. 16,64)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--run", required=True, help="the run's folder name under model_checkpoints/glue/")
    parser.add_argument("--task", required=True)
    parser.add_argument("--batch-sizes", default="1,16,64,1000",
                        help="comma-separated eval batch sizes; 1, the baseline, is always predicted (first)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    validate_args(parser, args)
    cfg = load_config(args.model_dir)
    task = get_task(args.task)
    tokenizer = load_model_tokenizer(cfg)
    state = load_checkpoint(cfg.checkpoint_dir / "glue" / args.run / "best.model")
    # The run's own model settings and input length (its --max-seq-len may differ from the model folder's)
    model_cfg = (config_from_dict({"model": as_recorded("model", state["model_config"])}).model
                 if isinstance(state.get("model_config"), dict) else cfg.model)
    max_seq_len = (state.get("settings") or {}).get("max_seq_len") or cfg.model.max_seq_len
    model = NystromformerForSequenceClassification(model_cfg, task.num_labels)
    model.load_state_dict(state["model_state_dict"])
    runner = Runner(model, torch.device(args.device), False)
    split = next(iter(task.dev))  # the first (MNLI: matched)
    examples = read_split(cfg.glue_dir, task, split).examples
    data = EncodedDataset(examples, tokenizer, max_seq_len, model_cfg.num_sen_type > 1)
    labels = [e.label for e in examples]
    print(f"# {task.name} {split} ({len(examples)} examples), {model_cfg.attn_type} with "
          f"{model_cfg.num_landmarks} landmarks, init {model_cfg.inv_coeff_init_option}, max_seq_len {max_seq_len}")
    print("| padding | eval batch size | dev metrics | predictions differing from batch size 1 | max abs output change |")
    print("|---|---|---|---|---|")
    for padding, pad_to in (("longest", None), ("fixed", max_seq_len)):
        collate = PadCollator(tokenizer.pad_token_id, task.is_regression, pad_to=pad_to)
        single = None  # batch size 1's outputs and predictions, the baseline
        for size in batch_sizes(args.batch_sizes):
            outputs = runner.predict(DataLoader(data, batch_size=size, collate_fn=collate))
            predictions = outputs if task.is_regression else outputs.argmax(-1)
            single = (outputs, predictions) if size == 1 else single
            metrics = ", ".join(f"{k} {v:.4f}" for k, v in split_metrics(task.name, predictions, labels).items())
            differing = ("n/a" if task.is_regression else str(int((predictions != single[1]).sum())))
            print(f"| {padding} | {size} | {metrics} | {differing} | {np.abs(outputs - single[0]).max():.2e} |",
                  flush=True)


if __name__ == "__main__":
    main()
