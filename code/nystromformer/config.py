"""The one config schema: a model folder's ``config.json``, validated on load.

Every key is declared once below with its type, default and allowed range. Loading rejects unknown
keys, wrong types and impossible values with an error that names the key (``model.head_dim``) and the
file, so a typo never silently falls back to a default. ``docs/config.md`` documents each key.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from .errors import UserError, first_undecodable_line


class ConfigError(UserError, ValueError):
    """A config.json that cannot be used; the message names the key and the file. ``key`` and ``reason``
    (when the error is about one key) let a command name its own flag when the value came from one."""

    def __init__(self, message: str, key: Optional[str] = None, reason: Optional[str] = None):
        super().__init__(message)
        self.key, self.reason = key, reason

    @classmethod
    def of_key(cls, key: str, reason: str) -> "ConfigError":
        return cls(f"{key}: {reason}", key, reason)


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError.of_key(key, msg)


# A typo guard (one zero too many), not a limit of the model: the position table alone would be > 1M rows.
MAX_SEQ_LEN = 1 << 20


ATTENTION_TYPES = ("softmax", "nystrom", "linformer", "performer", "linear", "reformer", "longformer", "bigbird",
                   "linformer_revisited")
# Linformer projection sharing: per head ("none"), one E and one F for all heads ("headwise"), one projection for
# keys and values of all heads ("kv"). Linformer's "layerwise" sharing (across layers) is not supported.
LINFORMER_SHARING = ("none", "headwise", "kv")
PINV_INITS = ("original", "exact")
HIDDEN_ACTS = ("gelu_tanh", "gelu")
# Keys added since checkpoints were first written, with the value a checkpoint that does not record them was
# trained with (their defaults changed on 2026-11-23): such a checkpoint resumes, validates, warm-starts, fine-tunes
# and exports only as trained (resume.config_differences, checkpoint.load_pretrained_weights, interop).
LEGACY_VALUES = {
    "model": {"hidden_act": "gelu"},
    "pretraining_setting": {"cycle_momentum": False},
}


def as_recorded(section: str, recorded: dict) -> dict:
    """A config section a checkpoint recorded, with LEGACY_VALUES for the keys it predates."""
    return {**LEGACY_VALUES.get(section, {}), **recorded}
WEIGHT_INITS = ("paper", "bert")


@dataclass
class ModelConfig:
    vocab_size: int = 50265
    num_sen_type: int = 1
    max_seq_len: int = 512
    embedding_dim: int = 768
    transformer_dim: int = 768
    transformer_hidden_dim: int = 3072
    num_layers: int = 12
    dropout_prob: float = 0.1
    num_head: int = 12
    head_dim: int = 64
    attn_type: str = "nystrom"
    num_landmarks: int = 64
    # None: no depthwise-conv skip on V (the paper's "no conv" ablation).
    conv_kernel_size: Optional[int] = None
    # Initial guess of the iterative pseudo-inverse: "original" is the paper's code (one scale for the
    # whole batch); "exact" is 1/(||A||_1 ||A||_inf) per matrix, the guess the convergence proof uses.
    inv_coeff_init_option: str = "original"
    pinv_iterations: int = 6
    # GELU of the feed-forward and MLM head: "gelu_tanh" is the authors' Approx_GeLU (transformers' "gelu_new"),
    # "gelu" the exact erf form (BERT's; what this pipeline used before 2026-11-23).
    hidden_act: str = "gelu_tanh"
    # Initial weights: "paper" as the authors' code (N(0, 0.02) embeddings, PyTorch's default uniform init for
    # every linear layer and the MLM bias); "bert" N(0, 0.02) weights and zero biases everywhere (BERT/RoBERTa's,
    # this pipeline's before 2026-11-23).
    weight_init: str = "paper"
    # Efficient-attention baselines (docs/attention.md); each key is read only by the variants named.
    linformer_k: int = 256                    # linformer, linformer_revisited: projected length k
    linformer_sharing: str = "none"           # linformer, linformer_revisited: one of LINFORMER_SHARING
    performer_num_features: int = 256         # performer: random features m
    performer_redraw_interval: int = 1000     # performer: redraw features every N training forwards (0: never)
    reformer_num_hashes: int = 2              # reformer: LSH rounds
    reformer_bucket_size: int = 32            # reformer: chunk length; buckets = padded length / bucket size
    window_size: int = 256                    # longformer: window width w (each token sees w//2 either side)
    num_global_tokens: int = 1                # longformer: the first tokens attend and are attended globally
    block_size: int = 64                      # bigbird: block length
    bigbird_num_random_blocks: int = 3        # bigbird: random key blocks per query block
    bigbird_num_global_blocks: int = 1        # bigbird: the first blocks attend and are attended globally
    # The paper's code computes attention in fp32 even under mixed precision.
    attention_fp32: bool = True
    mixed_precision: bool = True
    attention_grad_checkpointing: bool = False
    gelu_grad_checkpointing: bool = False
    layer_norm_eps: float = 1e-5
    # false: post-LayerNorm blocks (the paper's BERT/RoBERTa model); true: pre-LayerNorm blocks and a final
    # LayerNorm (the paper's LRA model).
    pre_layer_norm: bool = False
    # The data's padding id (meta.json's special_tokens.pad): pretraining checks the two agree, and export writes
    # it into transformers' config; masking and the model take padding from the data and the attention mask.
    pad_token_id: int = 1

    def validate(self, prefix: str = "model") -> None:
        for name in ("vocab_size", "num_sen_type", "max_seq_len", "embedding_dim", "transformer_dim",
                     "transformer_hidden_dim", "num_layers", "num_head", "head_dim", "num_landmarks"):
            _check(getattr(self, name) >= 1, f"{prefix}.{name}", f"must be >= 1, got {getattr(self, name)}")
        _check(self.max_seq_len <= MAX_SEQ_LEN, f"{prefix}.max_seq_len",
               f"must be <= {MAX_SEQ_LEN}, got {self.max_seq_len}")
        _check(0.0 <= self.dropout_prob < 1.0, f"{prefix}.dropout_prob", f"must be in [0, 1), got {self.dropout_prob}")
        _check(self.attn_type in ATTENTION_TYPES, f"{prefix}.attn_type",
               f"must be one of {', '.join(ATTENTION_TYPES)}; got {self.attn_type!r}")
        _check(self.num_head * self.head_dim == self.transformer_dim, f"{prefix}.head_dim",
               f"num_head ({self.num_head}) x head_dim ({self.head_dim}) = {self.num_head * self.head_dim} "
               f"must equal transformer_dim ({self.transformer_dim})")
        _check(self.inv_coeff_init_option in PINV_INITS, f"{prefix}.inv_coeff_init_option",
               f"must be one of {', '.join(PINV_INITS)}; got {self.inv_coeff_init_option!r}")
        _check(self.pinv_iterations >= 1, f"{prefix}.pinv_iterations", f"must be >= 1, got {self.pinv_iterations}")
        _check(self.hidden_act in HIDDEN_ACTS, f"{prefix}.hidden_act",
               f"must be one of {', '.join(HIDDEN_ACTS)}; got {self.hidden_act!r}")
        _check(self.weight_init in WEIGHT_INITS, f"{prefix}.weight_init",
               f"must be one of {', '.join(WEIGHT_INITS)}; got {self.weight_init!r}")
        if self.conv_kernel_size is not None:
            _check(self.conv_kernel_size >= 1 and self.conv_kernel_size % 2 == 1, f"{prefix}.conv_kernel_size",
                   f"must be a positive odd number (the conv keeps the length), got {self.conv_kernel_size}")
        for name in ("linformer_k", "performer_num_features", "reformer_num_hashes", "reformer_bucket_size",
                     "window_size", "block_size"):
            _check(getattr(self, name) >= 1, f"{prefix}.{name}", f"must be >= 1, got {getattr(self, name)}")
        for name in ("performer_redraw_interval", "num_global_tokens", "bigbird_num_random_blocks",
                     "bigbird_num_global_blocks"):
            _check(getattr(self, name) >= 0, f"{prefix}.{name}", f"must be >= 0, got {getattr(self, name)}")
        _check(self.linformer_sharing in LINFORMER_SHARING, f"{prefix}.linformer_sharing",
               f"must be one of {', '.join(LINFORMER_SHARING)}; got {self.linformer_sharing!r}")
        if self.attn_type in ("linformer", "linformer_revisited"):
            _check(self.linformer_k <= self.max_seq_len, f"{prefix}.linformer_k",
                   f"must be <= max_seq_len ({self.max_seq_len}), got {self.linformer_k}")
        if self.attn_type == "reformer":  # larger buckets pad every sequence up to them: slower, same model
            _check(self.reformer_bucket_size <= self.max_seq_len, f"{prefix}.reformer_bucket_size",
                   f"must be <= max_seq_len ({self.max_seq_len}), got {self.reformer_bucket_size}")
        _check(self.layer_norm_eps > 0, f"{prefix}.layer_norm_eps", "must be > 0")
        _check(0 <= self.pad_token_id < self.vocab_size, f"{prefix}.pad_token_id",
               f"must be a token id below vocab_size ({self.vocab_size}), got {self.pad_token_id}")


@dataclass
class PretrainingConfig:
    batch_size: int = 256
    learning_rate: float = 1e-4
    warmup: float = 0.01  # fraction of all steps spent warming up
    batches_per_report: int = 10
    batches_per_epoch: int = 5000
    epoch: int = 100
    validate_batches_per_epoch: int = 100
    mask_prob: float = 0.15
    weight_decay: float = 0.01
    adam_eps: float = 1e-6
    max_grad_norm: Optional[float] = None
    # The paper's OneCycleLR cycles Adam's beta1 against the learning rate (torch's default: 0.95 → 0.85 at the
    # peak → 0.95); false holds it at 0.9.
    cycle_momentum: bool = True
    seed: int = 0
    # How many epoch-end .cp files (weights + optimizer state, ~3x the weights) to keep; null keeps all, as the
    # paper. Every cp-NNNN.model (weights only) is kept regardless.
    keep_resume_checkpoints: Optional[int] = None

    def validate(self, prefix: str = "pretraining_setting") -> None:
        for name in ("batch_size", "batches_per_report", "batches_per_epoch", "epoch"):
            _check(getattr(self, name) >= 1, f"{prefix}.{name}", f"must be >= 1, got {getattr(self, name)}")
        _check(self.learning_rate > 0, f"{prefix}.learning_rate", f"must be > 0, got {self.learning_rate}")
        _check(0.0 < self.warmup < 1.0, f"{prefix}.warmup",
               f"is the fraction of steps spent warming up; must be in (0, 1), got {self.warmup}")
        _check(self.validate_batches_per_epoch >= 0, f"{prefix}.validate_batches_per_epoch", "must be >= 0")
        _check(0.0 < self.mask_prob < 1.0, f"{prefix}.mask_prob", f"must be in (0, 1), got {self.mask_prob}")
        _check(self.weight_decay >= 0, f"{prefix}.weight_decay", "must be >= 0")
        _check(self.adam_eps > 0, f"{prefix}.adam_eps", "must be > 0")
        _check(0 <= self.seed < 2 ** 63, f"{prefix}.seed", f"must be in [0, 2^63) (torch's seeds), got {self.seed}")
        if self.max_grad_norm is not None:
            _check(self.max_grad_norm > 0, f"{prefix}.max_grad_norm", "must be > 0 (or null to disable)")
        if self.keep_resume_checkpoints is not None:
            _check(self.keep_resume_checkpoints >= 1, f"{prefix}.keep_resume_checkpoints",
                   f"must be >= 1 (or null to keep all), got {self.keep_resume_checkpoints}")


COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")


@dataclass
class GpuConfig:
    # Most sequences one device processes per micro-step; gradient accumulation makes up batch_size. For Nyström
    # with the "original" init, part of the recipe: the init's max is over each micro-batch.
    inst_per_gpu: int = 32
    # Rows one forward/backward pass runs (default: inst_per_gpu), a multiple of inst_per_gpu: the Nyström init's
    # max is still taken over each inst_per_gpu rows, so the same recipe runs in fewer, larger passes.
    rows_per_pass: Optional[int] = None
    # torch.compile the encoder: "none", or a torch.compile mode ("reduce-overhead" = CUDA graphs, against the
    # host-bound launch rate of the Nyström layers; docs/performance.md). Off until a GPU run has timed it.
    compile: str = "none"

    @property
    def pass_rows(self) -> int:
        return self.rows_per_pass or self.inst_per_gpu

    def validate(self, prefix: str = "gpu_setting") -> None:
        _check(self.inst_per_gpu >= 1, f"{prefix}.inst_per_gpu", f"must be >= 1, got {self.inst_per_gpu}")
        if self.rows_per_pass is not None:
            _check(self.rows_per_pass >= 1 and self.rows_per_pass % self.inst_per_gpu == 0,
                   f"{prefix}.rows_per_pass", f"must be a positive multiple of inst_per_gpu ({self.inst_per_gpu}), "
                   f"or null for inst_per_gpu itself; got {self.rows_per_pass}")
        _check(self.compile in COMPILE_MODES, f"{prefix}.compile",
               f"must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    pretraining_setting: PretrainingConfig = field(default_factory=PretrainingConfig)
    gpu_setting: GpuConfig = field(default_factory=GpuConfig)
    # Paths, relative to the model folder (absolute paths are kept as they are).
    model_checkpoints: str = "model"
    data_folder: str = "dataset"
    glue_dataset_folder: str = "glue"
    # Optional warm start: a .model or .cp of another folder, used only while this folder has no checkpoint.
    from_cp: Optional[str] = None
    # Optional tokenizer folder (for GLUE and export); defaults to the data folder's meta.json tokenizer.
    tokenizer: Optional[str] = None
    # Where this config came from; not a key of config.json.
    model_dir: Path = field(default=Path("."), metadata={"internal": True})
    config_path: Optional[Path] = field(default=None, metadata={"internal": True})

    def validate(self) -> None:
        self.model.validate()
        self.pretraining_setting.validate()
        self.gpu_setting.validate()
        for name in ("model_checkpoints", "data_folder", "glue_dataset_folder"):
            _check(bool(getattr(self, name)), name, "must be a non-empty path")
        for name in ("from_cp", "tokenizer"):  # "" would resolve to the model folder itself
            _check(getattr(self, name) != "", name, "must be a non-empty path, or null (or left out) for none")

    def path(self, value: Optional[str]) -> Optional[Path]:
        """Resolve a path key relative to the model folder."""
        if value is None:
            return None
        p = Path(os.path.expanduser(value))
        return p if p.is_absolute() else (self.model_dir / p)

    @property
    def config_file(self) -> Path:
        """The config.json this config was loaded from, for error messages."""
        return self.config_path or self.model_dir / "config.json"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path(self.model_checkpoints)

    @property
    def data_dir(self) -> Path:
        return self.path(self.data_folder)

    @property
    def glue_dir(self) -> Path:
        return self.path(self.glue_dataset_folder)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for name in ("model_dir", "config_path"):
            out.pop(name)
        return out


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check a JSON value against a declared type; ints are accepted for floats, bools are not ints."""
    if get_origin(tp) is Union:
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, key)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp)
    if ok is None:
        raise TypeError(f"unsupported schema type {tp} for {key}")
    if not ok:
        raise ConfigError.of_key(key, f"expected {_type_name(tp)}, got {json.dumps(value)}")
    if tp is float and (abs(value) > sys.float_info.max if isinstance(value, int) else not math.isfinite(value)):
        # Python's json reads Infinity and NaN, and integers of any length (which float() cannot take)
        shown = json.dumps(value) if not isinstance(value, int) else f"an integer of {len(str(abs(value)))} digits"
        raise ConfigError.of_key(key, f"must be a finite number, got {shown}")
    return float(value) if tp is float else value


# Keys of the paper's released config files that this schema does not have: what to do instead of "unknown key"
PAPER_ONLY_KEYS = {
    "wikihop_dataset_folder": "the paper's WikiHop data folder: this pipeline has no WikiHop task; remove the key",
    "model.seq_len": "the paper's attention length beside max_seq_len: here max_seq_len is the one length (positions "
                     "and landmarks); remove the key, and check num_landmarks (the released nystrom-512 file has "
                     "the two swapped: seq_len 64, num_landmarks 512)",
}


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError.of_key(prefix or "config", f"expected an object, got {json.dumps(data)[:60]}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        key = f"{where}{unknown[0]}"
        if key in PAPER_ONLY_KEYS:
            raise ConfigError.of_key(key, PAPER_ONLY_KEYS[key])
        raise ConfigError.of_key(key, f"unknown key (known keys: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:
            kwargs[name] = _coerce(value, tp, key)
    return cls(**kwargs)


class _JsonObject(dict):
    """A parsed JSON object that remembers the keys it saw more than once."""
    duplicates: list


def _object_with_duplicates(pairs) -> _JsonObject:
    obj = _JsonObject()
    obj.duplicates = []
    for key, value in pairs:
        if key in obj and key not in obj.duplicates:
            obj.duplicates.append(key)
        obj[key] = value
    return obj


def _first_duplicate(value: Any, prefix: str = "") -> Optional[str]:
    """The dotted name of the first key that appears twice in one object (json keeps only the last)."""
    if isinstance(value, _JsonObject):
        if value.duplicates:
            return f"{prefix}{value.duplicates[0]}"
        for key, inner in value.items():
            if found := _first_duplicate(inner, f"{prefix}{key}."):
                return found
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            if found := _first_duplicate(inner, f"{prefix}{i}."):
                return found
    return None


def config_from_dict(data: dict, model_dir: Union[str, Path] = ".") -> Config:
    cfg = _build(Config, data, "")
    cfg.model_dir = Path(model_dir)
    cfg.validate()
    return cfg


def read_config_json(path: Path) -> Any:
    """The parsed JSON of a config.json, refusing what json.loads would let through silently (a key given twice)
    or report without its place (bytes that are not UTF-8)."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=_object_with_duplicates)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 (line {first_undecodable_line(path)}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    if duplicate := _first_duplicate(data):
        raise ConfigError(f"{path}: {duplicate}: appears more than once; keep one (JSON would silently use the last)")
    return data


def load_config(path: Union[str, Path]) -> Config:
    """Load ``config.json`` from a model folder (or the file itself) and validate it."""
    path = Path(path)
    # Absolute paths in the errors: a relative name says nothing inside a container's working folder
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path.parent.absolute()}: no config.json in this model folder")
    elif not path.exists() and not path.suffix:
        raise ConfigError(f"{path.absolute()}: no such model folder")
    if not path.is_file():
        raise ConfigError(f"no config file at {path.absolute()}")
    data = read_config_json(path)
    try:
        cfg = config_from_dict(data, path.parent)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}", e.key, e.reason) from None
    cfg.config_path = path
    return cfg
