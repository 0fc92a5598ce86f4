"""Fine-tune a pretrained checkpoint on one GLUE task: the paper's ``run_glue.py``, without transformers'
Trainer.

One run = (task, checkpoint, lr, batch size, epochs). Everything it writes lives in the model folder's
checkpoint dir (``model_checkpoints`` in config.json), named as the paper named its logs::

    <checkpoint_dir>/glue-<run>.log     JSON lines, one per epoch
    <checkpoint_dir>/glue/<run>/
        best.model        fine-tuned weights of the best dev epoch
        submission/*.tsv  test-set predictions of those weights, in the GLUE server's format
        result.json       written last; a run is complete when it exists and lists no submission_errors

with ``<run> = <task>-<checkpoint>-<lr>-<bs>-<epochs>``, plus ``-seed<N>`` when the seed is not 42 and
``-train<N>`` with ``--max-train-examples N``, so such runs do not replace the default one.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from .. import atomic
from ..attention import PADDING_AMOUNT_MATTERS
from ..checkpoint import find_model, load_pretrained_weights
from ..checkpoint import load as load_checkpoint
from ..cli import say
from ..config import MAX_SEQ_LEN, load_config
from ..errors import UserError
from ..model import NystromformerForSequenceClassification, fixed_weights, set_batch_groups
from ..resume import config_differences
from ..runtime import autocast_dtype, check_environment, linear_warmup_decay, resolve_device
from ..tokenizer import check_tokenizer_fits, load_model_tokenizer
from .encoding import EncodedDataset, PadCollator
from .metrics import better_score, combine_dev_metrics, split_metrics, task_score
from .submission import format_predictions, write_submission
from .tasks import (Example, GlueDataError, MissingGlueFile, Task, get_task, read_split, submission_source_exists,
                    submission_sources)

DEFAULT_SEED = 42
# Subsets (--max-train-examples) are drawn with this seed, not the run's, so every configuration of a
# sweep trains and evaluates on the same examples.
SUBSET_SEED = 0


class SettingsError(UserError, ValueError):
    """Impossible fine-tuning settings (a flag's value)."""


class SubmissionError(UserError, ValueError):
    """A test file could not be predicted completely; the trained run is kept and a rerun redoes the submission."""


class FineTuningDiverged(UserError, ValueError):
    """Every epoch's dev outputs were NaN or infinite; the run is recorded as finished, without submission."""


@dataclass
class FinetuneSettings:
    task: str
    checkpoint: int
    lr: float = 2e-5
    batch_size: int = 32
    epochs: int = 5
    seed: int = DEFAULT_SEED
    max_seq_len: Optional[int] = None       # default: the model's max_seq_len
    warmup: float = 0.06                    # fraction of all steps with a linearly rising learning rate
    weight_decay: float = 0.01
    max_train_examples: Optional[int] = None
    max_eval_examples: Optional[int] = None  # dev examples per dev split (test splits are always complete)
    submission: bool = True
    eval_batch_size: int = 64
    device: Optional[str] = None            # default: cuda if available, else cpu
    progress: bool = True                   # tqdm bar over training batches

    def __post_init__(self):
        task = get_task(self.task)
        self.task = task.name
        checks = [
            ("--lr", self.lr, math.isfinite(self.lr) and self.lr > 0, "must be a positive number"),
            ("--batch-size", self.batch_size, self.batch_size >= 1, "must be at least 1"),
            ("--epoch", self.epochs, self.epochs >= 1, "must be at least 1"),
            ("--warmup", self.warmup, 0 <= self.warmup < 1, "is the fraction of the steps warming up, in [0, 1)"),
            ("--weight-decay", self.weight_decay, math.isfinite(self.weight_decay) and self.weight_decay >= 0,
             "must be a number >= 0"),
            ("--seed", self.seed, 0 <= self.seed < 2 ** 32, "must be in [0, 2^32) (numpy's seeds)"),
            ("--eval-batch-size", self.eval_batch_size, self.eval_batch_size >= 1, "must be at least 1"),
        ]
        for name in ("max_train_examples", "max_eval_examples"):
            value = getattr(self, name)
            checks.append((f"--{name.replace('_', '-')}", value, value is None or value >= 1, "must be at least 1"))
        # <s> a </s> (+ </s> b </s> for pairs) and one token of each text: below that the tokenizer cannot
        # truncate to the length and would silently ignore it.
        shortest = 6 if any(columns.text_b is not None for _, columns in task.dev.values()) else 3
        checks.append(("--max-seq-len", self.max_seq_len, self.max_seq_len is None or self.max_seq_len >= shortest,
                       f"must be at least {shortest} for {task.name} (its special tokens and one token of each "
                       f"text)"))
        checks.append(("--max-seq-len", self.max_seq_len, self.max_seq_len is None or self.max_seq_len <= MAX_SEQ_LEN,
                       f"must be at most {MAX_SEQ_LEN}"))
        for flag, value, ok, rule in checks:
            if not ok:
                raise SettingsError(f"{flag}: {rule}, got {value}")

    @property
    def run_suffix(self) -> str:
        """``-seed<N>`` / ``-train<N>`` for a non-default seed / training subset; empty for the defaults, so the
        paper's names (and existing run folders) stay as they were."""
        suffix = f"-seed{self.seed}" if self.seed != DEFAULT_SEED else ""
        return suffix + (f"-train{self.max_train_examples}" if self.max_train_examples is not None else "")

    @property
    def run_name(self) -> str:
        return f"{self.task}-{self.checkpoint}-{self.lr:g}-{self.batch_size}-{self.epochs}{self.run_suffix}"


def run_dir(checkpoint_dir: Path, settings: FinetuneSettings) -> Path:
    return Path(checkpoint_dir) / "glue" / settings.run_name


def log_path(checkpoint_dir: Path, settings: FinetuneSettings) -> Path:
    return Path(checkpoint_dir) / f"glue-{settings.run_name}.log"


# Settings that do not change a run's dev scores (so a finished run still counts when they differ). A finished run
# made without test predictions that is asked for them gets them from its best.model (``submission_to_redo``).
PRESENTATION_SETTINGS = {"progress", "device", "eval_batch_size", "submission"}


def _stored_result(checkpoint_dir: Path, settings: FinetuneSettings) -> Optional[dict]:
    path = run_dir(checkpoint_dir, settings) / "result.json"
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return stored if isinstance(stored, dict) else None  # not a result this code wrote: the run is redone


def settings_differences(settings: FinetuneSettings, stored: dict) -> List[str]:
    """``"name old -> new"`` for each setting that changes results and differs from a stored run's."""
    wanted = dataclasses.asdict(settings)
    return [f"{k} {stored.get(k)} -> {v}" for k, v in wanted.items()
            if k not in PRESENTATION_SETTINGS and stored.get(k) != v]


# How a run padded its batches (collator), recorded in result.json. Runs without the record (before 2026-11-23)
# padded every model's batches to their longest example.
PADDED_TO_MAX_SEQ_LEN, PADDED_TO_LONGEST = "to max_seq_len", "to the longest example"


def padding_of(model_config) -> str:
    return PADDED_TO_MAX_SEQ_LEN if model_config.attn_type in PADDING_AMOUNT_MATTERS else PADDED_TO_LONGEST


# How dev and test examples are predicted, recorded in result.json: each alone (the attention's batch-wide
# statistics taken per example: model.set_batch_groups(model, 1)), since 2026-11-24. Before, Nystrom's "original"
# pseudo-inverse init took its maximum over the whole eval batch, so a prediction moved with its batch mates and
# --eval-batch-size (a review measured SST-2 dev accuracy 0.7167 / 0.7110 / 0.7099 at 1 / 64 / 872).
EACH_EXAMPLE_ALONE, WITH_ITS_BATCH = "each example alone", "with its batch"


def batch_coupled(model_config) -> bool:
    """Whether the model's predictions depend on their batch mates unless evaluated each alone."""
    return model_config.attn_type == "nystrom" and model_config.inv_coeff_init_option == "original"


# Model settings that trade memory for time and leave every number as it was
MEMORY_ONLY_MODEL_SETTINGS = {"attention_grad_checkpointing", "gelu_grad_checkpointing"}


def model_settings(model_config) -> dict:
    """config.json's model settings that a fine-tuning run's scores depend on — all but the gradient-checkpointing
    switches (``weight_init`` too: the head is initialised anew each run) —, recorded in result.json: a run made
    under other ones is not this run."""
    return {k: v for k, v in dataclasses.asdict(model_config).items() if k not in MEMORY_ONLY_MODEL_SETTINGS}


def method_of(model_config) -> dict:
    """How this model's runs must have padded and evaluated their batches, and under which model settings, for
    their scores to count: the evaluation only where the batch matters (``batch_coupled``)."""
    method = {"padding": padding_of(model_config), "model_settings": model_settings(model_config)}
    if batch_coupled(model_config):
        method["evaluation"] = EACH_EXAMPLE_ALONE
    return method


def recorded_padding(result: dict) -> str:
    return result.get("padding", PADDED_TO_LONGEST)


def recorded_method(result: dict) -> dict:
    """How a stored run padded and evaluated (runs without the records: to the longest example, with its batch),
    and its model settings (None for runs before 2026-11-25, which did not record them: taken as these)."""
    return {"padding": recorded_padding(result), "evaluation": result.get("evaluation", WITH_ITS_BATCH),
            "model_settings": result.get("model_settings")}


def method_differences(method: Optional[dict], result: dict) -> List[str]:
    """``"batches padded old -> new"`` / ``"examples evaluated old -> new"`` / ``"model.KEY old -> new"`` where
    ``result`` was made otherwise."""
    recorded, out = recorded_method(result), []
    words = {"padding": "batches padded", "evaluation": "examples evaluated"}
    for k, v in (method or {}).items():
        if k == "model_settings":
            old = recorded[k] or {}
            out += [f"model.{key} {json.dumps(old[key])} -> {json.dumps(value)}" for key, value in v.items()
                    if key in old and old[key] != value]
        elif recorded[k] != v:
            out.append(f"{words[k]} {recorded[k]} -> {v}")
    return out


def read_result(checkpoint_dir: Path, settings: FinetuneSettings, method: Optional[dict] = None) -> Optional[dict]:
    """The result of a run with these settings whose training completed, or None (a run of the same name made
    with other settings -- subset sizes, warm-up... -- does not count, nor, given ``method`` (``method_of``), one
    whose batches were padded or evaluated otherwise). See ``is_finished`` for the submission."""
    result = _stored_result(checkpoint_dir, settings)
    if result is None or settings_differences(settings, result.get("settings", {})):
        return None
    if method_differences(method, result):
        return None
    return result


def is_finished(result: Optional[dict], glue_dir: Optional[Path] = None, submission: bool = False) -> bool:
    """Trained and with every submission file written (a failed submission is redone by the next run), or
    missing only for want of a test file that is still not in ``glue_dir`` (when given); and, asked for a
    ``submission``, made with one."""
    return result is not None and not submission_to_redo(result, glue_dir, submission)


def submission_to_redo(result: dict, glue_dir: Optional[Path], wanted: bool = False) -> bool:
    """Whether a trained run's submission failed, lacks a file whose test file has appeared since, or (``wanted``)
    was not made (the run had --no-submission): each redone from its best.model, without training."""
    if result.get("diverged"):
        return False  # no epoch had a finite score: nothing to predict with
    if result.get("submission_errors"):
        return True
    if wanted and not result.get("settings", {}).get("submission", True):
        return True
    missing = result.get("submission_missing", [])
    return bool(missing) and glue_dir is not None and any(
        submission_source_exists(glue_dir, get_task(result["task"]), name) for name in missing)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def subsample(examples: List[Example], limit: Optional[int]) -> List[Example]:
    """A random subset of ``limit`` examples in file order (the file's head is often one class)."""
    if limit is None or len(examples) <= limit:
        return examples
    keep = sorted(random.Random(SUBSET_SEED).sample(range(len(examples)), limit))
    return [examples[i] for i in keep]


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float):
    # No weight decay on biases and LayerNorm weights, as BERT/RoBERTa fine-tuning does.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6)


class Runner:
    """Holds the model and device and knows how to move batches and run under autocast."""

    def __init__(self, model: torch.nn.Module, device: torch.device, mixed_precision: bool):
        self.model = model.to(device)
        self.device = device
        dtype = autocast_dtype(device, mixed_precision)  # as pretraining: bf16 where native, else fp16
        self.amp, self.amp_dtype = dtype is not None, dtype or torch.bfloat16
        # A loss scaler is only needed for fp16.
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp):
            return self.model(batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device),
                              batch["token_type_ids"].to(self.device) if "token_type_ids" in batch else None)

    @torch.no_grad()
    def predict(self, loader: DataLoader) -> np.ndarray:
        """Logits (n, classes), or scores (n,) for regression, in dataset order. fp16's range can overflow while
        the weights are fine: then predicted again in fp32 (as pretraining's dev evaluation)."""
        self.model.eval()
        set_batch_groups(self.model, 1)  # each example alone: no prediction moves with its batch mates

        def predict_all(amp: bool) -> np.ndarray:
            self.amp, was = amp, self.amp
            try:  # one autocast region for all batches: the weights' casts are made once (model.fixed_weights)
                with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=amp), fixed_weights(self.model):
                    return torch.cat([self.forward(batch).float().cpu() for batch in loader]).numpy()
            finally:
                self.amp = was

        try:
            outputs = predict_all(self.amp)
            if self.amp and self.amp_dtype == torch.float16 and not np.isfinite(outputs).all():
                outputs = predict_all(False)
        finally:
            set_batch_groups(self.model, None)  # training takes its statistics over its batch, as the paper's
        return outputs


def evaluate(runner: Runner, task: Task, loaders: Dict[str, DataLoader],
             labels: Dict[str, list]) -> Tuple[Dict[str, float], List[str]]:
    """Dev metrics, and the splits on which a classifier predicted one class for every example."""
    per_split, one_class = {}, []
    for split, loader in loaders.items():
        outputs = runner.predict(loader)
        predictions = outputs if task.is_regression else outputs.argmax(axis=-1)
        per_split[split] = split_metrics(task.name, predictions, labels[split])
        if not np.isfinite(outputs).all():  # argmax would turn NaN logits into class 0: a meaningless accuracy
            per_split[split] = {name: float("nan") for name in per_split[split]}
        elif not task.is_regression and len(predictions) > 1 and len(set(predictions.tolist())) == 1:
            one_class.append(split)
    return combine_dev_metrics(per_split), one_class


def majority_baseline(task: Task, train: List[Example], dev_labels: Dict[str, list]) -> Optional[float]:
    """The dev score of always predicting the training set's commonest label (None for regression)."""
    if task.is_regression:
        return None
    commonest = Counter(e.label for e in train).most_common(1)[0][0]
    return task_score(combine_dev_metrics({split: split_metrics(task.name, [commonest] * len(labels), labels)
                                           for split, labels in dev_labels.items()}))


def check_task_folder(cfg, task: Task) -> None:
    if not (cfg.glue_dir / task.folder).is_dir():
        raise GlueDataError(f"{cfg.config_file}: glue_dataset_folder: no {task.folder}/ in {cfg.glue_dir} (the "
                            f"GLUE data folder, with one folder per task)")


def _load_examples(glue_dir: Path, task: Task, split: str, log, skipped: Dict[str, int]) -> List[Example]:
    result = read_split(glue_dir, task, split)
    if not result.examples:  # one error line, with the rows' faults
        raise GlueDataError(result.report() or f"{result.path}: no rows")
    if result.report():
        log(f"warning: {result.report()}")
        skipped[split] = len(result.malformed)  # kept in result.json: a score over fewer rows than the file has
    return result.examples


def with_model_length(settings: FinetuneSettings, cfg) -> FinetuneSettings:
    """``settings`` with a --max-seq-len equal to the model's own as the default (None): the same run, the same
    run folder's result and the same sweep summary either way."""
    if settings.max_seq_len == cfg.model.max_seq_len:
        return dataclasses.replace(settings, max_seq_len=None)
    return settings


def check_max_seq_len(cfg, max_seq_len: Optional[int]) -> int:
    """The run's input length (``--max-seq-len``, default the model's). Checked before the data and the model (and
    by a sweep before its first run): else the warm start refuses it later, naming the config key instead."""
    model_len = cfg.model.max_seq_len
    max_seq_len = max_seq_len or model_len
    if max_seq_len > model_len and max_seq_len % model_len:
        raise SettingsError(f"--max-seq-len: {max_seq_len} is longer than the model's max_seq_len {model_len} but "
                            f"not a whole multiple of it; tiling the position embeddings needs one (e.g. "
                            f"{2 * model_len})")
    return max_seq_len


@dataclass
class TaskData:
    """A task's examples and loaders, all read before any training (a bad file fails first)."""
    train_examples: List[Example]
    dev_examples: Dict[str, List[Example]]  # per dev split (MNLI has two)
    train_loader: DataLoader
    dev_loaders: Dict[str, DataLoader]
    dev_labels: Dict[str, list]
    skipped_rows: Dict[str, int]  # malformed rows left out, per split (kept in result.json)


def load_task_data(cfg, task: Task, settings: FinetuneSettings, tokenizer, max_seq_len: int, log) -> TaskData:
    check_task_folder(cfg, task)
    skipped_rows: Dict[str, int] = {}
    train_examples = subsample(_load_examples(cfg.glue_dir, task, "train", log, skipped_rows),
                               settings.max_train_examples)
    dev_examples = {split: subsample(_load_examples(cfg.glue_dir, task, split, log, skipped_rows),
                                     settings.max_eval_examples)
                    for split in task.dev}
    if task.is_regression:
        for split, examples in dev_examples.items():
            labels = {e.label for e in examples}
            if len(labels) < 2:  # Pearson and Spearman are undefined: every epoch would score NaN, as if diverged
                raise SettingsError(f"{task.name} {split}: the {_count(len(examples), 'dev example')} scored have "
                                    f"{'one label' if labels else 'no label'} {' '.join(map(str, labels))}, so its "
                                    f"correlations are undefined; evaluate on more (--max-eval-examples "
                                    f"{settings.max_eval_examples})")
    collate = collator(cfg.model, tokenizer, task, max_seq_len)
    with_token_types = cfg.model.num_sen_type > 1
    encode = lambda examples: EncodedDataset(examples, tokenizer, max_seq_len, with_token_types)  # noqa: E731
    set_seed(settings.seed)
    train_loader = DataLoader(encode(train_examples), batch_size=settings.batch_size, shuffle=True,
                              collate_fn=collate, generator=torch.Generator().manual_seed(settings.seed))
    dev_loaders = {split: DataLoader(encode(ex), batch_size=settings.eval_batch_size, collate_fn=collate)
                   for split, ex in dev_examples.items()}
    dev_labels = {split: [e.label for e in ex] for split, ex in dev_examples.items()}
    return TaskData(train_examples, dev_examples, train_loader, dev_loaders, dev_labels, skipped_rows)


def _announce_other_model_settings(cfg, pretrained: Path, log, trained: Optional[dict]) -> None:
    """A warning naming config.json's model settings that differ from those ``pretrained`` recorded: fine-tuning
    uses config.json's (e.g. other landmarks or dropout, on purpose or by an edit since pretraining)."""
    if not (isinstance(trained, dict) and isinstance(trained.get("model"), dict)):
        return  # nothing recorded (or not as this pipeline writes it): nothing to compare
    changed = config_differences(trained, cfg, {"model": None})
    if changed:
        log(f"warning: {cfg.config_file}: model settings other than those {pretrained.name} was pretrained with ("
            + ", ".join(f"{key} {json.dumps(old)} -> {json.dumps(new)}" for _, key, old, new in changed)
            + "); fine-tuning with config.json's")


RUN_LOCK = "run.lock"


def _finished_earlier(previous: dict, out_dir: Path, log) -> dict:
    """A rerun of a finished run: its stored result, or its divergence again as the error it was."""
    again = "nothing to do. To train it again, delete that folder"
    if previous.get("diverged"):
        raise FineTuningDiverged(f"{out_dir}: finished earlier with these settings, and diverged (no epoch had a "
                                 f"finite dev score); {again}")
    log(f"{out_dir}: finished earlier with these settings (best dev score {previous['best_score']:.4f} at epoch "
        f"{previous['best_epoch']}); {again}")
    return previous


def finetune(model_dir: Union[str, Path], settings: FinetuneSettings, log: Callable[[str], None] = say) -> dict:
    """Fine-tune ``cp-<settings.checkpoint>.model`` of ``model_dir`` on ``settings.task``.

    Returns the result dict also written to result.json: best_epoch, best_score, best_metrics (dev),
    history (one entry per epoch), and the paths of the log, the best weights and the submission files.
    One run of a name at a time: once its checks pass, a run holds its folder's lock, and a second is refused
    until it ends (two would write one folder: the result of one beside the weights of the other).
    """
    check_environment()  # fail before the slow parts
    device = resolve_device(settings.device)
    cfg = load_config(model_dir)
    settings = with_model_length(settings, cfg)
    task = get_task(settings.task)
    checkpoint_dir = cfg.checkpoint_dir
    pretrained = find_model(checkpoint_dir, settings.checkpoint)
    out_dir = run_dir(checkpoint_dir, settings)
    # As `pretrain` on a finished run, and as glue-sweep decides it (is_finished): nothing to do, before the data
    # and the model are loaded; --no-submission keeps the files the run has.
    previous = read_result(checkpoint_dir, settings, method_of(cfg.model))
    if previous is not None and not submission_to_redo(previous, cfg.glue_dir, settings.submission):
        return _finished_earlier(previous, out_dir, log)
    atomic.check_writable_folder(out_dir, "the run's results")
    tokenizer = load_model_tokenizer(cfg)
    check_tokenizer_fits(cfg, tokenizer, log)
    max_seq_len = check_max_seq_len(cfg, settings.max_seq_len)
    data = load_task_data(cfg, task, settings, tokenizer, max_seq_len, log)

    # Model: the pretrained encoder plus a fresh head. Longer inputs than pretraining tile the positions.
    model_cfg = dataclasses.replace(cfg.model, max_seq_len=max(max_seq_len, cfg.model.max_seq_len))
    model = NystromformerForSequenceClassification(model_cfg, task.num_labels)
    load_pretrained_weights(model, pretrained, model_cfg.max_seq_len, log=log,
                            check_config=functools.partial(_announce_other_model_settings, cfg, pretrained, log))
    runner = Runner(model, device, cfg.model.mixed_precision)
    submit = functools.partial(_submit, runner, model, task, cfg.glue_dir, tokenizer, max_seq_len,
                               cfg.model.num_sen_type > 1, settings, out_dir, log=log)

    out_dir.mkdir(parents=True, exist_ok=True)

    def busy(holder: str) -> UserError:
        return UserError(f"{out_dir}: another fine-tuning run with these settings is in progress ({holder} holds "
                         f"{out_dir / RUN_LOCK}); wait for it to finish or stop it")

    def locked() -> dict:  # what reads and writes the run folder, under its lock
        best_path, log_file = out_dir / "best.model", log_path(checkpoint_dir, settings)
        padding, method = padding_of(cfg.model), method_of(cfg.model)
        previous = read_result(checkpoint_dir, settings, method)  # again: another run may have ended meanwhile
        if previous is not None and not submission_to_redo(previous, cfg.glue_dir, settings.submission):
            return _finished_earlier(previous, out_dir, log)
        if previous is not None and best_path.is_file():
            why = ("failed" if previous.get("submission_errors") else
                   "was not made (--no-submission)" if not previous["settings"].get("submission", True) else
                   "lacks a file whose test file is there now")
            log(f"{out_dir}: trained earlier, but its submission {why}; redoing only the submission from {best_path}")
            return submit(previous)
        if previous is not None:
            log(f"{out_dir}: its submission is to be redone, but {best_path.name} is gone: training the run again")
        stored = _stored_result(checkpoint_dir, settings)
        if stored is not None and previous is None:
            differences = (settings_differences(settings, stored.get("settings", {}))
                           + method_differences(method, stored))
            log(f"warning: replacing {out_dir}, a run made with other settings ({', '.join(differences)})")
        # A run is redone from here on: its old result must go before the first new weights do, or an interrupted
        # rerun would leave the old scores (a finished run to glue-sweep) beside the new run's best.model; so must its
        # test predictions and epoch log, which would otherwise sit beside weights they were not made from.
        if (out_dir / "result.json").exists():
            (out_dir / "result.json").unlink()
            atomic.fsync_dir(out_dir)
        if (out_dir / "submission").is_dir():
            shutil.rmtree(out_dir / "submission")
        log_file.unlink(missing_ok=True)

        total_steps = settings.epochs * len(data.train_loader)
        optimizer = build_optimizer(model, settings.lr, settings.weight_decay)
        scheduler = linear_warmup_decay(optimizer, total_steps, math.floor(settings.warmup * total_steps))
        if list(data.dev_examples) == ["dev"]:
            dev_counts = _count(len(data.dev_examples["dev"]), "dev example")
        else:
            dev_counts = " and ".join(f"{len(ex)} {s}" for s, ex in data.dev_examples.items()) + " examples"
        attention = ""
        if model_cfg.attn_type == "nystrom":  # which formulation and kernels produced the scores
            from ..attention.nystrom_fast import describe_switches
            attention = "; " + describe_switches(device)
        log(f"fine-tuning {pretrained} on {task.name}: {_count(len(data.train_examples), 'train example')}, "
            f"{dev_counts}, {_count(total_steps, 'step')} on {device}{attention}")
        baseline = majority_baseline(task, data.train_examples, data.dev_labels)
        if baseline is not None:
            log(f"{task.name}: always predicting the training set's commonest label scores {baseline:.4f} on dev")

        history, best = train_and_evaluate(runner, task, data, optimizer, scheduler, settings, model_cfg, best_path,
                                           log_file, log)
        result = {"settings": dataclasses.asdict(settings), "pretrained": str(pretrained), "task": task.name,
                  "best_epoch": best["epoch"], "best_score": best["score"], "best_metrics": best["dev"],
                  "history": history, "log": str(log_file), "best_weights": str(best_path),
                  "majority_baseline_score": baseline, "malformed_rows_skipped": data.skipped_rows, "padding": padding,
                  "evaluation": EACH_EXAMPLE_ALONE, "model_settings": model_settings(cfg.model),
                  "submission": [], "submission_errors": [], "submission_missing": []}
        if math.isnan(best["score"]):
            # Finished (a rerun would diverge again: a sweep skips it, its summary ranks it last), without submission.
            atomic.write_json(out_dir / "result.json", {**result, "diverged": True})
            raise FineTuningDiverged(f"{task.name}: no epoch has a finite dev score: the model's outputs are NaN or "
                                     f"infinite (a diverged pretraining checkpoint, or too high a learning rate: "
                                     f"{settings.lr:g}); no submission written; results in {out_dir}")
        log(f"{task.name}: best dev score {best['score']:.4f} at epoch {best['epoch']}; results in {out_dir}")
        return submit(result)

    with atomic.exclusive_lock(out_dir / RUN_LOCK, busy):
        return locked()


def train_and_evaluate(runner: Runner, task: Task, data: TaskData, optimizer, scheduler,
                       settings: FinetuneSettings, model_cfg, best_path: Path, log_file: Path,
                       log) -> Tuple[List[dict], dict]:
    """The epochs: train, evaluate on dev, keep the best weights (best.model) and rewrite the log; returns the
    history (one entry per epoch) and the best entry."""
    history: List[dict] = []
    best: Optional[dict] = None
    start = time.time()
    for epoch in range(1, settings.epochs + 1):  # 1-based: "epoch 3" = after three passes
        bar = tqdm(data.train_loader, desc=f"{task.name} epoch {epoch}/{settings.epochs}", leave=False,
                   disable=not settings.progress)
        train_loss = train_one_epoch(runner, bar, optimizer, scheduler)
        metrics, one_class = evaluate(runner, task, data.dev_loaders, data.dev_labels)
        entry = {"epoch": epoch, "train_loss": train_loss, "dev": metrics,
                 "score": task_score(metrics), "lr": scheduler.get_last_lr()[0],
                 "elapsed_s": round(time.time() - start, 2)}
        if best is None or better_score(entry["score"], best["score"]):
            best = entry
            atomic.torch_save(best_path, {"model_state_dict": runner.model.state_dict(), "task": task.name,
                                          "num_labels": task.num_labels, "epoch": epoch, "dev": metrics,
                                          "model_config": dataclasses.asdict(model_cfg),
                                          "settings": dataclasses.asdict(settings)})
        entry["best_score"] = best["score"]
        history.append(entry)
        # The whole log is rewritten each epoch: atomic, and a restarted run starts a fresh log.
        atomic.write_text(log_file, "".join(json.dumps(h) + "\n" for h in history))
        log(f"{task.name} epoch {epoch}/{settings.epochs}: train loss {entry['train_loss']:.4f}, dev "
            + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if one_class:
            log(f"warning: {task.name} epoch {epoch}: the model predicts one class for every {' and '.join(one_class)} "
                f"example (a degenerate classifier: try another learning rate or more epochs)")
    return history, best


def train_one_epoch(runner: Runner, batches: tqdm, optimizer, scheduler) -> float:
    """One pass over the training batches (a progress bar over the loader); returns the mean training loss."""
    model = runner.model
    model.train()
    loss_sum, count = 0.0, 0
    for batch in batches:
        logits = runner.forward(batch)
        loss = model.loss(logits, batch["labels"].to(runner.device))
        optimizer.zero_grad(set_to_none=True)
        runner.scaler.scale(loss).backward()
        runner.scaler.step(optimizer)
        runner.scaler.update()
        scheduler.step()
        loss_sum += loss.item()
        count += 1
        batches.set_postfix(loss=f"{loss_sum / count:.4f}", refresh=False)  # shown with the count that includes it
    return loss_sum / max(count, 1)


def collator(model_config, tokenizer, task: Task, max_seq_len: int) -> PadCollator:
    """Batches padded to their longest example, or to ``max_seq_len`` for attention whose outputs depend on the
    amount of padding (Nyström: else a short batch would move its landmarks, or at most num_landmarks tokens
    make it exact softmax, and an example's prediction would depend on its batch)."""
    return PadCollator(tokenizer.pad_token_id, task.is_regression,
                       pad_to=max_seq_len if padding_of(model_config) == PADDED_TO_MAX_SEQ_LEN else None)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _submit(runner: Runner, model: torch.nn.Module, task: Task, glue_dir: Path, tokenizer, max_seq_len: int,
            with_token_types: bool, settings: FinetuneSettings, out_dir: Path, result: dict, log) -> dict:
    """Predict the test files with the best weights and write result.json (also when a test file fails, so
    that a rerun redoes only this step); raises SubmissionError when a submission file could not be written."""
    files, errors, missing = [], [], []
    if settings.submission:
        weights = load_checkpoint(out_dir / "best.model")["model_state_dict"]  # a CheckpointError names a bad file
        model.load_state_dict(weights)
        files, errors, missing = write_task_submission(runner, task, glue_dir, tokenizer, max_seq_len,
                                                       with_token_types, settings.eval_batch_size,
                                                       out_dir / "submission", log)
    result = {**result, "settings": {**result["settings"], "submission": settings.submission},
              "submission": [str(p) for p in files], "submission_errors": errors, "submission_missing": missing}
    atomic.write_json(out_dir / "result.json", result)
    if errors:
        raise SubmissionError(f"{'; '.join(errors)}. The trained run is kept in {out_dir}: fix the file and rerun "
                              f"the same command, which redoes only the submission")
    return result


def write_task_submission(runner: Runner, task: Task, glue_dir: Path, tokenizer, max_seq_len: int,
                          with_token_types: bool, batch_size: int,
                          out_dir: Path, log) -> Tuple[List[Path], List[str], List[str]]:
    """Predict every test split of the task (and AX for MNLI); returns the files written, one error per file that
    could not be (a test file that is unreadable or has a malformed row, non-finite outputs) and the names of the
    files whose test file is absent (reported, not an error: a rerun writes them once the test file is there)."""
    written, errors, missing = [], [], []
    collate = collator(runner.model.config, tokenizer, task, max_seq_len)
    for file_name, read in submission_sources(glue_dir, task).items():
        try:
            result = read()
        except MissingGlueFile as e:
            log(f"no {file_name} submission: {e} (once it is there, rerunning the same command redoes the "
                f"submission, without training)")
            missing.append(file_name)
            continue
        except GlueDataError as e:
            errors.append(f"{e}; {file_name} not written")
            continue
        if result.report():
            # The GLUE server rejects a file with missing indices: fail the run rather than write a bad file.
            errors.append(f"{result.report()}; {file_name} not written (the GLUE server needs every index)")
            continue
        if not result.examples:
            errors.append(f"{result.path}: no rows after the header; {file_name} not written")
            continue
        loader = DataLoader(EncodedDataset(result.examples, tokenizer, max_seq_len, with_token_types),
                            batch_size=batch_size, collate_fn=collate)
        outputs = runner.predict(loader)
        bad = int((~np.isfinite(outputs)).reshape(len(outputs), -1).any(axis=1).sum())
        if bad:
            errors.append(f"{file_name}: the model's outputs are NaN or infinite for {bad} of {len(outputs)} test "
                          f"rows (a diverged run); not written")
            continue
        predictions = format_predictions(task.labels, outputs)
        write_submission(out_dir / file_name, [e.index for e in result.examples], predictions)
        written.append(out_dir / file_name)
    if written:
        log(f"wrote {', '.join(p.name for p in written)} to {out_dir}")
    return written, errors, missing
