"""MLM validation of pretraining checkpoints on the dev split, logged like the paper's validation_output.log.

    nystromformer validate --model-dir nystrom-512               # every cp-NNNN.model not yet validated
    nystromformer validate --model-dir nystrom-512 --checkpoint 3
"""
from __future__ import annotations

import argparse
import fcntl
import json
import math
import time
from typing import Dict, List, Optional


from . import atomic, checkpoint, jsonlog
from .jsonlog import JsonLog
from .cli import add_subcommand, say, script_main
from .config import Config, ConfigError, load_config
from .errors import UserError
from .mlm import DEV_EVAL_VERSION, accuracy_note, evaluate_fp16_safe
from .model import NystromformerForMaskedLM, set_batch_groups
from .resume import check_data, config_differences
from .runtime import setup_runtime
from .shards import ShardedSequences

LOG_NAME = "validation_output.log"
# What a checkpoint's dev figures depend on besides its weights (None: every model key that changes what is
# computed); the paper's dev points were measured with the run's own masking.
VALIDATION_KEYS = {"model": None, "pretraining_setting": {"mask_prob", "seed"}}


def current_entries(cfg: Config) -> Dict[str, dict]:
    """The validation log's entries measured by this dev evaluation (DEV_EVAL_VERSION), by checkpoint name."""
    path = cfg.checkpoint_dir / LOG_NAME
    if not path.is_file():
        return {}
    return {e["checkpoint"]: e for e in jsonlog.read(path)
            if "checkpoint" in e and e.get("eval_version") == DEV_EVAL_VERSION}


def validated_checkpoints(cfg: Config) -> set:
    """Checkpoint names whose entry measured the weights the file holds now: a run started afresh in the same
    folder writes other weights under the same names (entries before 2026-11-29 have no fingerprint: by name)."""
    return {name for name, e in current_entries(cfg).items()
            if "fingerprint" not in e or not (cfg.checkpoint_dir / name).is_file()
            or e["fingerprint"] == checkpoint.fingerprint(cfg.checkpoint_dir / name)}


def older_entries(cfg: Config) -> int:
    """Entries of the validation log measured by an earlier dev evaluation (another DEV_EVAL_VERSION) whose
    checkpoint this evaluation has not measured yet."""
    path = cfg.checkpoint_dir / LOG_NAME
    if not path.is_file():
        return 0
    measured = current_entries(cfg)
    return sum(e.get("eval_version") != DEV_EVAL_VERSION and e.get("checkpoint") not in measured
               for e in jsonlog.read(path))


def record(cfg: Config, entry: dict) -> Optional[dict]:
    """Log ``entry``. It replaces (the log rewritten atomically) this dev evaluation's line of the same checkpoint
    file measured on as many sequences, or measured when the file held other weights (rewritten by a new run):
    one line per measurement that still describes the file. Returns the first replaced line."""
    path = cfg.checkpoint_dir / LOG_NAME
    with open(cfg.checkpoint_dir / f".{LOG_NAME}.lock", "a") as lock:
        try:  # another validate of this folder reads, changes and rewrites the log too: one at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # a file system without flock: as before, unlocked
            pass
        return _record_locked(path, entry)


def _record_locked(path, entry: dict) -> Optional[dict]:
    entries = jsonlog.read(path) if path.is_file() else []
    same = [i for i, e in enumerate(entries)
            if e.get("checkpoint") == entry["checkpoint"] and e.get("eval_version") == DEV_EVAL_VERSION
            and (e.get("num_sequences") == entry["num_sequences"]
                 or e.get("fingerprint", entry["fingerprint"]) != entry["fingerprint"])]
    if not same:
        JsonLog(path).write(**entry)
        return None
    replaced = entries[same[0]]
    kept = [entry if i == same[0] else e for i, e in enumerate(entries) if i == same[0] or i not in same]
    atomic.write_text(path, "".join(json.dumps(e) + "\n" for e in kept))
    return replaced


def validate(cfg: Config, epochs: Optional[List[int]] = None, num_sequences: Optional[int] = None,
             device: Optional[str] = None) -> List[dict]:
    """Validate the given checkpoints (default: every one not yet in the log); returns the new entries.

    A checkpoint whose dev loss is not finite (weights a diverged run left behind) is not logged — the log stays
    strict JSON and holds no accuracy taken from NaN scores; the others are, and then a ``UserError`` names it."""
    if num_sequences is not None and num_sequences < 1:
        raise ConfigError(f"--num-sequences: must be >= 1, got {num_sequences}")
    rt = setup_runtime(cfg.model.mixed_precision, device)
    ps = cfg.pretraining_setting
    dev = ShardedSequences(cfg.data_dir, "dev")
    check_data(cfg, dev)
    if num_sequences is None:
        num_sequences = max(ps.validate_batches_per_epoch, 1) * ps.batch_size
    if not checkpoint.available_models(cfg.checkpoint_dir):
        raise checkpoint.CheckpointError(f"no checkpoint cp-NNNN.model in {cfg.checkpoint_dir}: nothing has been "
                                         f"pretrained in this model folder yet")
    if epochs is None:
        done = validated_checkpoints(cfg)
        older = older_entries(cfg)
        if older:
            say(f"warning: {cfg.checkpoint_dir / LOG_NAME}: {older} entries were measured by an earlier "
                f"dev evaluation (no \"eval_version\": {DEV_EVAL_VERSION}; before 2026-11-23 it took the dev split's "
                f"first rows, one corpus); their checkpoints are measured again and the new entries added beside them")
        epochs = [e for e in checkpoint.available_models(cfg.checkpoint_dir)
                  if checkpoint.model_path(cfg.checkpoint_dir, e).name not in done]
    epochs = list(dict.fromkeys(epochs))  # --checkpoint 3 --checkpoint 3 measures it once
    atomic.check_writable_folder(cfg.checkpoint_dir, LOG_NAME)
    results, diverged = [], []
    model = NystromformerForMaskedLM(cfg.model).to(rt.device)
    set_batch_groups(model, cfg.gpu_setting.inst_per_gpu)  # the init per micro-batch, as in pretraining
    for epoch in epochs:
        path = checkpoint.find_model(cfg.checkpoint_dir, epoch)
        state = checkpoint.load(path, map_location=rt.device)
        # The checkpoint's own architecture and masking: a config.json edited since would measure another model.
        for section, key, old, new in config_differences(state.get("config"), cfg, VALIDATION_KEYS):
            raise ConfigError(f"{cfg.config_file}: {section}.{key}: is {json.dumps(new)} but {path.name} was "
                              f"trained with {json.dumps(old)}; validation would measure another setting. Restore "
                              f"the value to validate this checkpoint")
        model.load_state_dict(state["model_state_dict"])
        t0 = time.perf_counter()
        metrics, redone = evaluate_fp16_safe(model, dev, num_sequences, cfg.gpu_setting.pass_rows, ps.seed,
                                             ps.mask_prob, rt.device, rt.autocast_dtype)
        if not math.isfinite(metrics["loss"]):
            print(f"{path.name}: dev loss {metrics['loss']}: its weights diverged (not logged)")
            diverged.append(path.name)
            continue
        entry = {"checkpoint": path.name, "epoch": epoch, **metrics, "time": time.perf_counter() - t0,
                 "fingerprint": checkpoint.fingerprint(path),
                 **({"precision": "fp32 (fp16 overflowed)"} if redone else {})}
        replaced = record(cfg, entry)
        print(f"{path.name}: dev loss {entry['loss']:.4f}, MLM accuracy {entry['mlm_accu']:.4f}"
              f"{accuracy_note(entry)}, {entry['num_sequences']} sequences")
        if replaced is not None:
            before = replaced.get("fingerprint")
            weights = ("measured again" if before is None else "the same weights" if before == entry["fingerprint"]
                       else "other weights under this name")
            print(f"  (replaces its earlier line in {LOG_NAME}: dev loss {replaced.get('loss')}, "
                  f"{replaced.get('num_sequences')} sequences; {weights})")
        results.append(entry)
    if diverged:
        raise UserError(f"{', '.join(diverged)} in {cfg.checkpoint_dir}: the dev loss is not finite (the weights "
                        f"diverged); not written to {LOG_NAME}" + (f", the other {len(results)} checkpoint(s) were"
                                                                  if results else ""))
    if not results:
        print(f"nothing to validate in {cfg.checkpoint_dir} (every checkpoint is already in {LOG_NAME})")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=".", help="model folder holding config.json (default: current directory)")
    parser.add_argument("--checkpoint", type=int, action="append", default=None,
                        help="epoch number of cp-NNNN.model to validate (repeatable; default: all not yet validated)")
    parser.add_argument("--num-sequences", type=int, default=None,
                        help="dev sequences to use (default: validate_batches_per_epoch x batch_size, at least one "
                             "batch)")
    parser.add_argument("--device", default=None)


def run(args: argparse.Namespace) -> int:
    validate(load_config(args.model_dir), args.checkpoint, args.num_sequences, args.device)
    return 0


def add_commands(subparsers) -> None:
    add_subcommand(subparsers, "validate", "MLM loss/accuracy of checkpoints on the dev split", __doc__, add_arguments, run)


def main(argv=None) -> int:
    return script_main("run_validation.py", __doc__, add_arguments, run, argv)
