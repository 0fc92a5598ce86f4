"""Resuming a pretraining run exactly: what a checkpoint records of its config and data, the checks that refuse
to resume something else (or to start over an earlier run), and the RNG state."""
from __future__ import annotations

import hashlib
import json
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint, jsonlog
from .cli import say
from .config import LEGACY_VALUES, Config, ConfigError
from .runtime import Runtime
from .shards import ShardedSequences, ShardError

# What identifies the training data, so that a resumed run reads the same sequences: the meta.json fields that
# shape the token stream (not "tokenizer", an absolute path that differs between clusters and checkouts), the
# shard list (file name, number of sequences) and, as reading all would take minutes on a full corpus, the first
# and last rows of each shard. Bump DATA_RECORD_FORMAT when what is recorded changes.
DATA_RECORD_FORMAT = 2
DATA_META_KEYS = ("max_seq_len", "vocab_size", "dtype", "special_tokens", "datasets", "dev_fraction", "dev_run",
                  "seed", "shard_size")  # a record is compared on the keys it holds: adding one needs no new format


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """(Every training step reseeds from the seed and its number: this restores only what runs before it.) The
    saving machine may have had more or fewer GPUs than this one: each present gets its own saved state, if any."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for index, device_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)


# Keys that may change between a run and its resumption: they do not change what is computed (inst_per_gpu: for
# Nyström slightly, through the pinv init's batch-wide scale; allowed so that a run can move to a smaller GPU;
# rows_per_pass: to rounding without dropout, the init's max staying over each inst_per_gpu rows; with dropout
# its masks are drawn per pass, so differently — the same distribution, not the same draws).
RESUME_MAY_CHANGE = {
    "model": {"attention_grad_checkpointing", "gelu_grad_checkpointing", "mixed_precision", "weight_init"},
    "pretraining_setting": {"batches_per_report", "validate_batches_per_epoch", "keep_resume_checkpoints"},
    "gpu_setting": {"inst_per_gpu", "rows_per_pass", "compile"},
}


def config_differences(saved: Optional[dict], cfg: Config, keys: dict) -> List[tuple]:
    """(section, key, saved value, current value) for each of ``keys`` ({section: names, or None for every key
    but RESUME_MAY_CHANGE's}) where the config a checkpoint recorded and ``cfg`` differ."""
    current = cfg.to_dict()
    out = []
    for section, names in keys.items():
        recorded = (saved or {}).get(section, {})
        legacy = {k: v for k, v in LEGACY_VALUES.get(section, {}).items() if saved and k not in recorded}
        for key, old in {**recorded, **legacy}.items():
            if (key in names) if names is not None else (key not in RESUME_MAY_CHANGE[section]):
                new = current[section].get(key)
                if old != new:
                    out.append((section, key, old, new))
    return out


def check_resumable_config(saved: Optional[dict], cfg: Config, path: str) -> None:
    """Refuse to resume under a config that changes the run (schedule, data position, architecture): the
    resumed run would silently differ from the one it continues."""
    for section, key, old, new in config_differences(saved, cfg, dict.fromkeys(RESUME_MAY_CHANGE)):
        raise ConfigError(
            f"{cfg.config_file}: {section}.{key}: is {json.dumps(new)} but {path} was trained with "
            f"{json.dumps(old)}; resuming would not continue that run. Restore the value, or start a new "
            f'model folder with "from_cp" pointing at this checkpoint')


def data_fingerprint(data_dir, train: ShardedSequences) -> dict:
    """What identifies the training data (see DATA_META_KEYS): kept in every .cp, compared on resume."""
    # ShardedSequences has checked that train.json's list matches the shards' shapes.
    index = json.loads((data_dir / "train.json").read_text())
    shards = [(entry["file"], int(entry["num_sequences"])) for entry in index["shards"]]
    rows = hashlib.sha256()
    for array in train.arrays:
        if len(array):
            rows.update(np.ascontiguousarray(array[[0, -1]]).tobytes())
    return {"format": DATA_RECORD_FORMAT, "meta": {k: train.meta.get(k) for k in DATA_META_KEYS},
            "shards": hashlib.sha256(json.dumps(shards).encode()).hexdigest(),
            "num_shards": len(shards), "num_sequences": len(train), "rows": rows.hexdigest()}


def check_resumable_data(saved: Optional[dict], cfg: Config, current: dict, path: str, log=say) -> None:
    """Refuse to resume on other training data than the checkpoint's."""
    # A checkpoint from before this record (none), or with an older format (hashes of meta.json's raw bytes,
    # which held the tokenizer's path): nothing comparable was kept, so it resumes unchecked, not refused.
    if not isinstance(saved, dict) or saved.get("format") != DATA_RECORD_FORMAT:
        log(f"warning: {path} has no record of its training data in this version's format; resuming without "
            f"checking that {cfg.data_dir} is the same data")
        return
    meta = cfg.data_dir / "meta.json"
    changed = [f"{meta}: {key} was {json.dumps(old)}, is {json.dumps(current['meta'].get(key))}"
               for key, old in saved["meta"].items() if old != current["meta"].get(key)]
    if saved["shards"] != current["shards"]:
        changed.append(f"{cfg.data_dir / 'train.json'}: the shard list (file names and sequence counts) differs: "
                       f"{saved['num_shards']} shard(s) of {saved['num_sequences']} sequences then, "
                       f"{current['num_shards']} of {current['num_sequences']} now")
    if saved["rows"] != current["rows"]:
        changed.append(f"the training shards listed in {cfg.data_dir / 'train.json'}: their first or last rows "
                       f"differ")
    if changed:
        raise ConfigError(
            f"{cfg.config_file}: data_folder: {cfg.data_dir} is not the data {path} was trained on "
            f"({'; '.join(changed)}); resuming would not continue that run. Restore the data, or start a new "
            f"model folder with \"from_cp\" pointing at this checkpoint")


def check_from_cp_location(ckpt_dir, from_cp, epochs: int, config_file="config.json") -> None:
    """``from_cp`` may lie in the run's own checkpoint folder only under a name the run neither writes nor
    resumes from (checked before any resume: a .cp there would be resumed from, not warm-started from)."""
    source = from_cp.resolve()
    if source.is_file() and source.parent == ckpt_dir.resolve():
        m = checkpoint.EPOCH_MODEL.match(source.name)
        resumable = checkpoint.STEP_CP.match(source.name) or checkpoint.EPOCH_CP.match(source.name)
        if resumable or (m and int(m.group(1)) < epochs):
            why = ("a .cp there is taken for this run's own checkpoint and resumed from, not warm-started from"
                   if resumable else "the run writes its own checkpoints there and would overwrite it")
            raise ConfigError(
                f"{config_file}: from_cp: {from_cp} lies in this run's checkpoint folder ({why}); move it out of "
                f"{ckpt_dir} (or copy it to another name) and point from_cp there")


def refuse_to_overwrite_history(ckpt_dir, log_path, batches_per_epoch: int, from_cp=None) -> None:
    """With no resumable checkpoint, a fresh start would truncate the log and overwrite the checkpoints of an
    earlier run: refuse if the folder holds any. A log of steps never checkpointed (a hard kill in the first
    epoch) is no history: the fresh start redoes exactly those steps. Nor is ``from_cp``'s file, put there to
    warm-start from (``check_from_cp_location`` has made sure the run will not overwrite it)."""
    source = from_cp.resolve() if from_cp is not None else None
    names = sorted(p.name for p in ckpt_dir.iterdir()
                   if (checkpoint.EPOCH_CP.match(p.name) or checkpoint.EPOCH_MODEL.match(p.name)
                       or checkpoint.STEP_CP.match(p.name)) and p.resolve() != source)
    if log_path.is_file() and any(e.get("type") in ("dev", "preempted", "resume")
                                  # the epoch's last step is logged before its checkpoint is written
                                  or e.get("step", 0) > batches_per_epoch for e in jsonlog.read(log_path)):
        names.append(log_path.name)
    if names:
        listing = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        raise checkpoint.CheckpointError(
            f"{ckpt_dir}: holds an earlier run ({listing}) but no readable .cp checkpoint to resume it from; "
            f"starting over would overwrite it. Move or delete those files to start afresh, or restore a good "
            f".cp to resume")


def check_same_step_on_every_rank(step: int, rt: Runtime) -> None:
    steps = torch.tensor([step, -step], device=rt.device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    if steps[0].item() != -steps[1].item():
        raise checkpoint.CheckpointError(
            f"ranks resumed from different steps (between {-steps[1].item()} and {steps[0].item()}): every node "
            f"must see the same checkpoint folder")


def check_data(cfg: Config, data: ShardedSequences, pretraining: bool = False) -> None:
    """The data split is not empty and fits the model's settings."""
    meta, where = data.meta, f"{cfg.config_file}: model"
    if len(data) == 0:
        stats = data.folder / "stats.json"
        raise ShardError(f"{data.folder / (data.split + '.json')}: the {data.split} split holds no sequences"
                         + (f" (see the warnings in {stats}: a --dev-run too long for this data?)"
                            if data.split == "dev" and stats.is_file() else "")
                         + (f"; or set pretraining_setting.validate_batches_per_epoch to 0 in {cfg.config_file}"
                            if data.split == "dev" and pretraining else ""))
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"{where}.vocab_size: {cfg.model.vocab_size} is smaller than the data's vocabulary "
                          f"({meta['vocab_size']} in {data.folder / 'meta.json'})")
    if meta["max_seq_len"] > cfg.model.max_seq_len:
        raise ConfigError(f"{where}.max_seq_len: {cfg.model.max_seq_len} is shorter than the data's sequences "
                          f"({meta['max_seq_len']} in {data.folder / 'meta.json'})")
    if meta["special_tokens"]["pad"] != cfg.model.pad_token_id:
        raise ConfigError(f"{where}.pad_token_id: {cfg.model.pad_token_id} differs from the data's pad id "
                          f"{meta['special_tokens']['pad']} ({data.folder / 'meta.json'})")


def dev_point_missing(log_path, step: int, rt: Runtime) -> bool:
    """Whether the log lacks the dev evaluation at ``step`` (decided alike on every rank: it is a collective)."""
    entries = jsonlog.read(log_path) if log_path.is_file() else []
    missing = not any(e.get("type") == "dev" and e.get("step") == step for e in entries)
    if rt.world_size > 1:
        flag = torch.tensor([float(missing)], device=rt.device)
        dist.broadcast(flag, src=0)  # rank 0's log is the one written
        missing = bool(flag.item())
    return missing
