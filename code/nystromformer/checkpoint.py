"""Checkpoint files, with the names users of the paper's repo know.

- ``cp-NNNN.model``: ``{"model_state_dict": ..., "epoch": NNNN, "step": ..., "config": ...}`` written at the
  end of epoch NNNN (0-based): the weights alone, for validation, fine-tuning and ``from_cp``.
- ``cp-NNNN.cp``: everything needed to resume (weights, optimizer, scheduler, scaler, epoch, step,
  inst_pass, RNG states); ``epoch`` is that of the last step done (NNNN, as in the .model), ``step`` what counts.
- ``step-YYYYYYYY.cp``: the same, written mid-epoch when the run is stopped (SIGTERM, SIGINT, --stop-at-step).

Every write is atomic; every load uses ``weights_only=True`` (no arbitrary unpickling).
"""
from __future__ import annotations

import hashlib
import pickle
import re
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from . import atomic
from .cli import say
from .config import as_recorded
from .errors import UserError
from .model import POSITION_OFFSET

EPOCH_CP = re.compile(r"^cp-(\d{4,})\.cp$")
EPOCH_MODEL = re.compile(r"^cp-(\d{4,})\.model$")
STEP_CP = re.compile(r"^step-(\d{8,})\.cp$")
POSITION_KEY = "encoder.embeddings.position_embeddings.weight"


class CheckpointError(UserError, RuntimeError):
    pass


def model_path(checkpoint_dir: Path, epoch: int) -> Path:
    return Path(checkpoint_dir) / f"cp-{epoch:04d}.model"


def save_epoch(checkpoint_dir: Path, epoch: int, state: dict, keep: Optional[int] = None) -> None:
    """Write cp-NNNN.model then cp-NNNN.cp; the .cp, written last, marks the epoch complete. ``keep``: how many
    epoch .cp files to keep (the newest; None: all); every .model stays."""
    checkpoint_dir = Path(checkpoint_dir)
    weights = {"model_state_dict": state["model_state_dict"], "epoch": epoch, "step": state["step"],
               "config": state.get("config")}
    atomic.torch_save(model_path(checkpoint_dir, epoch), weights)
    atomic.torch_save(checkpoint_dir / f"cp-{epoch:04d}.cp", state)
    # A mid-epoch checkpoint older than this one is now stale.
    for path in checkpoint_dir.glob("step-*.cp"):
        m = STEP_CP.match(path.name)
        if m and int(m.group(1)) <= state["step"]:
            path.unlink()
    if keep is not None:
        epochs = sorted(int(m.group(1)) for p in checkpoint_dir.glob("cp-*.cp") if (m := EPOCH_CP.match(p.name)))
        for old in epochs[:-keep]:
            (checkpoint_dir / f"cp-{old:04d}.cp").unlink()


def save_preempted(checkpoint_dir: Path, state: dict) -> Path:
    path = Path(checkpoint_dir) / f"step-{state['step']:08d}.cp"
    atomic.torch_save(path, state)
    return path


def remove_stale_temp_files(checkpoint_dir: Path) -> None:
    """Temporary files of atomic writes interrupted by a hard kill (they can be GBs)."""
    for path in Path(checkpoint_dir).glob(".*.tmp"):
        if path.is_file():  # atomic.py's temporaries are files; a folder of that name is not ours to delete
            path.unlink()


def resumable_checkpoints(checkpoint_dir: Path, batches_per_epoch: int) -> List[Tuple[int, Path]]:
    """(global step, path) of every resumable checkpoint in the folder, newest first."""
    found = []
    for path in Path(checkpoint_dir).glob("*.cp"):
        if m := EPOCH_CP.match(path.name):
            found.append(((int(m.group(1)) + 1) * batches_per_epoch, path))
        elif m := STEP_CP.match(path.name):
            found.append((int(m.group(1)), path))
    return sorted(found, key=lambda t: (t[0], t[1].name.startswith("cp-")), reverse=True)


def load(path: Union[str, Path], map_location="cpu") -> dict:
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a folder; a checkpoint is a cp-NNNN.model or .cp file") from None
    except pickle.UnpicklingError as e:  # torch's message is a page of advice, some of it to unpickle anyway
        with open(path, "rb") as f:
            head = f.read(4)
        if not head.startswith((b"PK\x03\x04", b"\x80")):  # neither torch.save's zip nor its legacy pickle
            raise CheckpointError(f"{path}: not a checkpoint: not a file torch.save wrote (it begins {head!r})") \
                from None
        what = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise CheckpointError(f"{path}: unreadable checkpoint: it holds a Python object "
                              f"({what.group(1) if what else 'not a tensor or plain value'}) that loading would have "
                              f"to run code to rebuild; only tensors and plain values are loaded") from None
    except (PermissionError, MemoryError, torch.cuda.OutOfMemoryError):
        raise  # the machine's state, not the file's: reported as what it is (cli names an unreadable file)
    except Exception as e:  # truncated zip, bad magic...
        raise CheckpointError(f"{path}: unreadable checkpoint: not a file torch.save wrote, or damaged "
                              f"({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict) or "model_state_dict" not in obj:
        raise CheckpointError(f"{path}: not a checkpoint of this project (no model_state_dict)")
    return obj


# What a .cp holds besides the weights, and a resume needs (a .model has only model_state_dict and config)
RESUME_KEYS = ("optimizer_state_dict", "scheduler_state_dict", "scaler_state_dict", "rng_state", "step")


def load_newest_resumable(checkpoint_dir: Path, batches_per_epoch: int, log=say) -> Optional[dict]:
    """The newest checkpoint that loads; a corrupt newer one is reported and skipped."""
    for step, path in resumable_checkpoints(checkpoint_dir, batches_per_epoch):
        try:
            state = load(path)
        except CheckpointError as e:
            log(f"warning: skipping {e}; falling back to an older checkpoint")
            continue
        missing = [key for key in RESUME_KEYS if key not in state]
        if missing:
            log(f"warning: skipping {path}: not a resumable checkpoint (no {', '.join(missing)}): a weights-only "
                f".model under a .cp name?; falling back to an older checkpoint")
            continue
        state["path"] = str(path)
        return state
    return None


def available_models(checkpoint_dir: Path) -> List[int]:
    return sorted(int(m.group(1)) for p in Path(checkpoint_dir).glob("cp-*.model")
                  if (m := EPOCH_MODEL.match(p.name)))


def fingerprint(path: Union[str, Path]) -> str:
    """What a checkpoint file holds, read cheaply: torch.save writes a zip whose central directory (at the end,
    read without the records) lists every record's name, size and CRC-32, so other weights under the same name
    give another fingerprint. A file that is not a zip is hashed whole."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                digest.update(f"{info.filename}\0{info.file_size}\0{info.CRC}\n".encode())
    except zipfile.BadZipFile:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def find_model(checkpoint_dir: Path, epoch: int) -> Path:
    """The path of cp-<epoch>.model, or an error listing the checkpoints there are."""
    if epoch < 0:
        raise CheckpointError(f"--checkpoint {epoch}: an epoch number, from 0")
    path = model_path(checkpoint_dir, epoch)
    if not path.is_file():
        have = available_models(checkpoint_dir)
        listing = ", ".join(str(e) for e in have) if have else "none"
        raise CheckpointError(f"no checkpoint {path.name} in {checkpoint_dir}; available checkpoints: {listing}")
    return path


def extend_position_embeddings(state_dict: Dict[str, torch.Tensor], max_seq_len: int) -> Dict[str, torch.Tensor]:
    """Grow the learned position table to ``max_seq_len`` as the paper did for 4096 from 512:
    keep the first two (unused, RoBERTa offset) rows and tile the learned rows."""
    old = state_dict[POSITION_KEY]
    old_len = old.shape[0] - POSITION_OFFSET
    if max_seq_len == old_len:
        return state_dict
    if max_seq_len < old_len:
        raise CheckpointError(f"model.max_seq_len: {max_seq_len} is shorter than the checkpoint's length {old_len}; "
                              f"a warm start keeps or lengthens the sequences (tiling the position embeddings), "
                              f"it cannot shorten them")
    if max_seq_len % old_len:
        raise CheckpointError(f"model.max_seq_len: {max_seq_len} is not a multiple of the checkpoint's length "
                              f"{old_len}; tiling its position embeddings needs a whole multiple")
    rows = old[POSITION_OFFSET:].repeat(max_seq_len // old_len, 1)
    state_dict = dict(state_dict)
    state_dict[POSITION_KEY] = torch.cat([old[:POSITION_OFFSET], rows], dim=0)
    return state_dict


def _check_same_activation(obj: dict, model: torch.nn.Module, path) -> None:
    """The GELU the checkpoint was trained with (recorded, or the old default when it predates the key) must be the
    model's: the weights would load either way and silently compute another function."""
    recorded = obj.get("config") if isinstance(obj.get("config"), dict) else None
    if not isinstance((recorded or {}).get("model"), dict) or not hasattr(model, "config"):
        return
    trained = as_recorded("model", recorded["model"]).get("hidden_act")
    if trained != model.config.hidden_act:
        raise CheckpointError(f"{path}: was trained with model.hidden_act {trained!r}, but config.json's model has "
                              f"{model.config.hidden_act!r}; set \"hidden_act\": \"{trained}\" in config.json's model "
                              f"section to use these weights as trained")


def load_pretrained_weights(model: torch.nn.Module, path: Union[str, Path], max_seq_len: int,
                            log=say, check_config=None) -> Tuple[List[str], List[str]]:
    """Initialise ``model`` from a .model or .cp file, tiling position embeddings when longer.
    Returns (missing, unexpected) keys, which are reported: a fine-tuning head is expected to be missing.
    ``check_config``, if given, is called with the config the checkpoint recorded (None if none) first."""
    obj = load(path)
    if check_config is not None:
        check_config(obj.get("config"))
    state = obj["model_state_dict"]
    _check_same_activation(obj, model, path)
    own = model.state_dict()
    # The encoder must come whole from the checkpoint (only a task head may be new): a missing or extra encoder
    # weight means config.json describes another architecture, and fine-tuning would start from random layers.
    for keys, what in (([k for k in own if k.startswith("encoder.") and k not in state], "lacks"),
                       ([k for k in state if k.startswith("encoder.") and k not in own], "has an extra")):
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise CheckpointError(f"{path}: {what} encoder weight {keys[0]}{more} for the model config.json "
                                  f"describes; is it the same architecture (model.num_layers, attn_type, "
                                  f"conv_kernel_size, ...)?")
    old_len = state[POSITION_KEY].shape[0] - POSITION_OFFSET
    state = extend_position_embeddings(state, max_seq_len)
    if old_len != max_seq_len:
        log(f"position embeddings tiled from {old_len} to {max_seq_len} positions ({max_seq_len // old_len} copies "
            f"of the checkpoint's)")
    mismatched = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    if mismatched:
        k = mismatched[0]
        raise CheckpointError(f"{path}: {k} has shape {tuple(state[k].shape)}, the model expects "
                              f"{tuple(own[k].shape)} (is config.json the same architecture?)")
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys:
        log(f"initialised from {path}; not in the checkpoint (left at init): {', '.join(result.missing_keys)}")
    if result.unexpected_keys:
        log(f"initialised from {path}; unused checkpoint keys: {', '.join(result.unexpected_keys)}")
    return result.missing_keys, result.unexpected_keys
