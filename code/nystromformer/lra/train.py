"""ListOps training runner: one model per attention type, LRA settings by default, results table out.

Defaults are the LRA / Nyströmformer-paper ListOps settings: 2 layers, dim 64, 2 heads, FFN 128, mean
pooling, batch 32, AdamW lr 1e-4 (no weight decay), 1000 linear warm-up steps then linear decay, 5000
steps, dev evaluation every 50 steps, max length 2000, 10 classes; the test accuracy reported is the one
of the checkpoint with the best dev accuracy. Every setting is a flag, so tests and CPU runs can shrink it.
"""
from __future__ import annotations

import csv
import io
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import atomic
from ..cli import say
from ..config import ModelConfig, config_from_dict
from ..attention import PADDING_AMOUNT_MATTERS
from ..model import Encoder, init_weights, set_batch_groups
from ..errors import UserError
from ..runtime import linear_warmup_decay, resolve_device
from . import listops

# Per-attention hyper-parameters of the LRA comparison (Nyströmformer paper, Table 6 setup).
LRA_ATTENTION = {
    "softmax": {},
    "nystrom": {"num_landmarks": 64, "conv_kernel_size": 35},
    "linformer": {"linformer_k": 256},
    "performer": {"performer_num_features": 256},
    "linear": {},
    "reformer": {"reformer_num_hashes": 2, "reformer_bucket_size": 32},
    "longformer": {"window_size": 256, "num_global_tokens": 1},
    "bigbird": {"block_size": 64, "bigbird_num_random_blocks": 3, "bigbird_num_global_blocks": 1},
    "linformer_revisited": {"linformer_k": 256},
}


@dataclass
class RunSettings:
    num_layers: int = 2
    dim: int = 64
    num_head: int = 2
    ffn_dim: int = 128
    dropout: float = 0.1
    batch_size: int = 32
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    warmup: int = 1000
    steps: int = 5000
    eval_every: int = 50
    eval_batches: Optional[int] = None  # None: the whole dev split at every evaluation
    max_length: int = 2000
    seed: int = 0
    device: Optional[str] = None  # None: cuda when there is a GPU, else cpu (as pretrain and glue)
    time_limit_s: Optional[float] = None  # stop training after this many seconds; the table reports steps run

    def __post_init__(self):
        # Checked here, not deep in training (a modulo by zero, an empty best checkpoint); named as the flag.
        at_least = {"num_layers": 1, "dim": 1, "num_head": 1, "ffn_dim": 1, "batch_size": 1, "warmup": 0,
                    "steps": 1, "eval_every": 1, "max_length": 1}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise UserError(f"--{name.replace('_', '-')}: must be at least {low}, got {getattr(self, name)}")
        if self.warmup >= self.steps:
            raise UserError(f"--warmup: {self.warmup} warm-up steps are not fewer than --steps {self.steps}: the rate "
                            f"would never reach its peak and decay; lower --warmup")
        for name in ("learning_rate", "eval_batches"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise UserError(f"--{name.replace('_', '-')}: must be positive, got {value}")
        for name in ("weight_decay", "time_limit_s"):  # a time limit of 0 s: one step, then dev and test
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < math.inf:
                raise UserError(f"--{name.replace('_', '-')}: must be at least 0, got {getattr(self, name)}")


class ListOpsClassifier(nn.Module):
    """Encoder → masked mean over real tokens → Linear-ReLU-Linear to 10 classes."""

    def __init__(self, cfg: ModelConfig, hidden: int, num_classes: int = listops.NUM_CLASSES):
        super().__init__()
        self.encoder = Encoder(cfg)
        self.head = nn.Sequential(nn.Linear(cfg.transformer_dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        init_weights(self, cfg.weight_init)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(ids, mask)
        m = mask.to(h.dtype)[..., None]
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(pooled)


def model_config(attn_type: str, s: RunSettings, overrides: Optional[dict] = None) -> ModelConfig:
    """The LRA model's settings for ``attn_type``, with the user's ``overrides`` (``--set``) checked by the config
    schema: an unknown key or a wrong type is a ConfigError naming it."""
    model = dict(vocab_size=len(listops.VOCAB), pad_token_id=listops.PAD_ID, max_seq_len=s.max_length,
                 embedding_dim=s.dim, transformer_dim=s.dim, transformer_hidden_dim=s.ffn_dim,
                 num_layers=s.num_layers, num_head=s.num_head, head_dim=s.dim // s.num_head,
                 dropout_prob=s.dropout, attn_type=attn_type, mixed_precision=False,
                 pre_layer_norm=True,  # the paper's LRA model is pre-LayerNorm
                 # as every LRA run in docs/results.md was made (the authors' LRA code is another codebase)
                 hidden_act="gelu", weight_init="bert")
    model.update(LRA_ATTENTION.get(attn_type, {}))
    # Keep the defaults' sequence-sized hyper-parameters legal when a reduced run shortens the sequences (a value
    # given with --set is the user's: checked by the schema below, never changed).
    for key in ("linformer_k", "reformer_bucket_size"):
        if key in model and isinstance(model[key], int):
            model[key] = min(model[key], s.max_length)
    model.update(overrides or {})
    return config_from_dict({"model": model}).model


def padded_length(attn_type: str, s: RunSettings) -> Optional[int]:
    """--max-length for the attention types whose outputs depend on the amount of padding (Nyström's segment-mean
    landmarks, Reformer's bucket count, BigBird's block layout move with the padded length), as the authors' LRA
    code pads every input to 2000; None (each batch to its longest row) for the others, whose outputs do not."""
    return s.max_length if attn_type in PADDING_AMOUNT_MATTERS else None


def batches(data: List[Tuple[List[int], int]], batch_size: int, shuffle: bool, rng: Optional[random.Random] = None,
            pad_to: Optional[int] = None):
    """(ids, mask, labels) batches, padded to ``pad_to`` tokens, or to the batch's longest row when None."""
    order = list(range(len(data)))
    if shuffle:
        rng.shuffle(order)
    for i in range(0, len(order), batch_size):
        chunk = [data[j] for j in order[i:i + batch_size]]
        n = pad_to or max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), n), listops.PAD_ID, dtype=torch.long)
        mask = torch.zeros(len(chunk), n, dtype=torch.long)
        for r, (seq, _) in enumerate(chunk):
            if len(seq) > n:
                raise ValueError(f"a row of {len(seq)} tokens does not fit the padded length {n}")
            ids[r, :len(seq)] = torch.tensor(seq)
            mask[r, :len(seq)] = 1
        yield ids, mask, torch.tensor([lab for _, lab in chunk])


@torch.no_grad()
def accuracy(model: nn.Module, data, batch_size: int, device, max_batches: Optional[int] = None,
             pad_to: Optional[int] = None) -> float:
    """Accuracy of ``model`` on ``data``, each row predicted alone: padded as in training (``pad_to``) and with
    batch-wide statistics (Nyström's "original" pseudo-inverse init) taken per row, so that no prediction moves with
    its batch mates or the batch size (as GLUE's predictions, docs/glue.md). The model's mode is restored."""
    was_training = model.training
    model.eval()
    set_batch_groups(model, 1)
    correct = total = 0
    try:
        for i, (ids, mask, y) in enumerate(batches(data, batch_size, shuffle=False, pad_to=pad_to)):
            if max_batches is not None and i >= max_batches:
                break
            pred = model(ids.to(device), mask.to(device)).argmax(-1).cpu()
            correct += int((pred == y).sum())
            total += len(y)
    finally:
        set_batch_groups(model, None)  # training takes its statistics over the batch, as the paper's recipe
        model.train(was_training)
    return correct / max(total, 1)


def train_one(attn_type: str, splits: Dict[str, list], s: RunSettings, overrides: Optional[dict] = None,
              log=None) -> dict:
    empty = [split for split in ("train", "dev", "test") if not splits[split]]
    if empty:  # an empty training split would loop for ever looking for a batch
        raise ValueError(f"no rows in the {', '.join(empty)} split(s)")
    torch.manual_seed(s.seed)
    rng = random.Random(s.seed)
    device = resolve_device(s.device)
    model = ListOpsClassifier(model_config(attn_type, s, overrides), hidden=s.ffn_dim).to(device)
    pad_to = padded_length(attn_type, s)
    opt = torch.optim.AdamW(model.parameters(), lr=s.learning_rate, weight_decay=s.weight_decay)
    schedule = linear_warmup_decay(opt, s.steps, s.warmup)
    best_dev, best_state, best_step = -1.0, None, 0
    step, start, eval_seconds = 0, time.time(), 0.0
    # the logged loss: the mean over the steps since the last evaluation, summed on the device (an .item() a step
    # would wait for the GPU every step)
    loss_sum, loss_steps = torch.zeros((), device=device), 0
    stopped_early = False
    model.train()
    while step < s.steps and not stopped_early:
        for ids, mask, y in batches(splits["train"], s.batch_size, shuffle=True, rng=rng, pad_to=pad_to):
            loss = F.cross_entropy(model(ids.to(device), mask.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            step += 1
            loss_sum, loss_steps = loss_sum + loss.detach(), loss_steps + 1
            # stopped early: the time limit struck before the planned last step (not on it)
            stopped_early = (s.time_limit_s is not None and step < s.steps
                             and time.time() - start > s.time_limit_s)
            if step % s.eval_every == 0 or step == s.steps or stopped_early:
                eval_start = time.time()
                dev = accuracy(model, splits["dev"], s.batch_size, device, s.eval_batches, pad_to)
                eval_seconds += time.time() - eval_start
                if log:
                    log(json.dumps({"attn_type": attn_type, "seed": s.seed, "step": step,
                                    "loss": round(loss_sum.item() / loss_steps, 4), "dev_accuracy": round(dev, 4),
                                    "elapsed_s": round(time.time() - start, 1)}))
                loss_sum, loss_steps = torch.zeros((), device=device), 0
                if dev > best_dev:
                    best_dev, best_step = dev, step
                    best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
            if step >= s.steps or stopped_early:
                break
    train_seconds = time.time() - start - eval_seconds
    model.load_state_dict(best_state)
    eval_start = time.time()
    test = accuracy(model, splits["test"], s.batch_size, device, pad_to=pad_to)
    eval_seconds += time.time() - eval_start
    if stopped_early and log:
        log(json.dumps({"attn_type": attn_type, "seed": s.seed, "stopped_early": True, "step": step,
                        "planned_steps": s.steps, "time_limit_s": s.time_limit_s}))
    return {"attn_type": attn_type, "seed": s.seed, "best_dev_accuracy": best_dev, "best_step": best_step,
            "test_accuracy": test, "steps": step, "train_seconds": round(train_seconds, 1),
            "eval_seconds": round(eval_seconds, 1), "padding": f"to {pad_to} tokens" if pad_to else "to the longest row",
            "params": sum(p.numel() for p in model.parameters())}


def majority_accuracy(train, test) -> float:
    counts = [0] * listops.NUM_CLASSES
    for _, lab in train:
        counts[lab] += 1
    top = max(range(len(counts)), key=counts.__getitem__)
    return sum(lab == top for _, lab in test) / max(len(test), 1)


def encode_splits(raw: Dict[str, list], max_length: int, log=say) -> Dict[str, list]:
    """{split: [(tokens or source text, label)]} → {split: [(ids, label)]} truncated to max_length (as LRA does);
    how many expressions were cut is said, per split (a cut expression's label may no longer follow from it)."""
    out = {}
    for split, rows in raw.items():
        tokens = [src.split() if isinstance(src, str) else src for src, _ in rows]
        cut = sum(len(t) > max_length for t in tokens)
        if cut:
            log(f"warning: --max-length {max_length}: {cut} of {len(rows)} {split} expressions are longer and were "
                f"truncated")
        out[split] = [(listops.encode(t, max_length), lab) for t, (_, lab) in zip(tokens, rows)]
    return out


def write_results(results: List[dict], out_dir: Path, title: str, settings: RunSettings, majority: float) -> None:
    """``listops_results.csv`` (one row per run) and ``listops_results.md`` (the runs, then mean ± sample standard
    deviation over seeds for each attention type that ran with more than one seed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cols = ["attn_type", "seed", "test_accuracy", "best_dev_accuracy", "best_step", "steps", "train_seconds",
            "eval_seconds", "padding", "params"]
    table = io.StringIO(newline="")
    w = csv.DictWriter(table, fieldnames=cols)
    w.writeheader()
    for r in results:
        w.writerow({c: r[c] for c in cols})
    atomic.write_text(out_dir / "listops_results.csv", table.getvalue())  # rewritten after each run: never torn
    # the seeds the runs used (--seeds replaces --seed, which would name one that may not have run)
    shown = {**{k: v for k, v in settings.__dict__.items() if k != "seed"},
             "seeds": list(dict.fromkeys(r["seed"] for r in results))}
    lines = [f"## {title}", "", f"Settings: `{json.dumps(shown)}`", "",
             f"Majority-class test accuracy: {100 * majority:.2f}%", "",
             "| attention | seed | test acc. (%) | best dev acc. (%) | best step | steps | train time (s) | "
             "eval time (s) | padding | params |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['attn_type']} | {r['seed']} | {100 * r['test_accuracy']:.2f} | "
                     f"{100 * r['best_dev_accuracy']:.2f} | {r['best_step']} | {r['steps']} | {r['train_seconds']} | "
                     f"{r['eval_seconds']} | {r['padding']} | {r['params']} |")
    by_type: Dict[str, List[dict]] = {}
    for r in results:
        by_type.setdefault(r["attn_type"], []).append(r)
    multi = {t: rs for t, rs in by_type.items() if len(rs) > 1}
    if multi:
        lines += ["", "Over seeds (mean ± sample standard deviation):", "",
                  "| attention | seeds | test acc. (%) | best dev acc. (%) |", "|---|---|---|---|"]
        for t, rs in multi.items():
            test = [100 * r["test_accuracy"] for r in rs]
            dev = [100 * r["best_dev_accuracy"] for r in rs]
            lines.append(f"| {t} | {len(rs)} | {statistics.mean(test):.2f} ± {statistics.stdev(test):.2f} | "
                         f"{statistics.mean(dev):.2f} ± {statistics.stdev(dev):.2f} |")
    atomic.write_text(out_dir / "listops_results.md", "\n".join(lines) + "\n")
