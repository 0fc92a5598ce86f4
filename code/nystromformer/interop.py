"""Interop with Hugging Face transformers: export our checkpoints as transformers Nyströmformer folders, and
import transformers Nyströmformer (or RoBERTa) weights as a warm start for our pipeline.

    nystromformer export-hf --model-dir nystrom-512 --checkpoint 9 --output hf-nystrom-512
    nystromformer export-hf --model-dir nystrom-512 --glue-weights nystrom-512/model/glue/.../best.model --output hf-sst2
    nystromformer import-hf --input nystromformer-512 --model-dir nystrom-512-continued
    nystromformer import-hf --input roberta-base --model-dir nystrom-4096 --max-seq-len 4096

Export refuses (naming the option) any model that transformers would compute differently from us on the
inputs it accepts; see docs/interop.md for the parameter mapping and transformers' known defects.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from . import atomic, checkpoint
from .cli import add_subcommand, say
from .config import (Config, ConfigError, ModelConfig, as_recorded, config_from_dict, load_config,
                     read_config_json)
from .errors import UserError
from .model import POSITION_OFFSET, NystromformerForMaskedLM, NystromformerForSequenceClassification
from .shards import ShardError, read_meta
from .tokenizer import (TOKENIZER_FILES, TokenizerError, check_tokenizer_is_the_datas, load_tokenizer,
                        model_tokenizer)

PathLike = Union[str, Path]
# transformers' NystromformerSelfAttention.iterative_inv always runs 6 iterations.
HF_PINV_ITERATIONS = 6
IMPORTED_WEIGHTS = "imported/hf-import.model"
STAGING_SUFFIX = ".export-staging"  # the hidden folder an export is written into before it is renamed in place
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's, in a state dict saved from the wrapper
HF_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                    "max_position_embeddings")


class InteropError(UserError, ValueError):
    """A model that cannot be exported/imported faithfully; the message names the option."""


# ---------------------------------------------------------------------------------------------------------
# Parameter names. Our layer-local names -> transformers' (identical for Nyströmformer and RoBERTa).
_LAYER_KEYS = [
    ("attention.query.", "attention.self.query."),
    ("attention.key.", "attention.self.key."),
    ("attention.value.", "attention.self.value."),
    ("attention.attn.conv.", "attention.self.conv."),
    ("attention.output.", "attention.output.dense."),
    ("norm1.", "attention.output.LayerNorm."),
    ("ffn.dense_in.", "intermediate.dense."),
    ("ffn.dense_out.", "output.dense."),
    ("norm2.", "output.LayerNorm."),
]
_EMBEDDING_KEYS = [
    ("encoder.embeddings.word_embeddings.", "embeddings.word_embeddings."),
    ("encoder.embeddings.position_embeddings.", "embeddings.position_embeddings."),
    ("encoder.embeddings.token_type_embeddings.", "embeddings.token_type_embeddings."),
    ("encoder.embeddings.norm.", "embeddings.LayerNorm."),
]
_HEAD_KEYS = {
    "nystromformer": [("mlm_head.dense.", "cls.predictions.transform.dense."),
                      ("mlm_head.norm.", "cls.predictions.transform.LayerNorm."),
                      ("mlm_head.bias", "cls.predictions.bias"),
                      ("classifier.dense.", "classifier.dense."),
                      ("classifier.out_proj.", "classifier.out_proj.")],
    # RoBERTa's classification head uses tanh (ours and transformers' Nyströmformer use GELU): not mapped.
    "roberta": [("mlm_head.dense.", "lm_head.dense."),
                ("mlm_head.norm.", "lm_head.layer_norm."),
                ("mlm_head.bias", "lm_head.bias")],
}
_LAYER_RE = re.compile(r"^encoder\.layers\.(\d+)\.(.*)$")


def hf_key(ours: str, family: str = "nystromformer") -> str:
    """transformers' name of one of our parameters (``family``: ``nystromformer`` or ``roberta``)."""
    base = f"{family}."
    if m := _LAYER_RE.match(ours):
        i, rest = m.groups()
        for a, b in _LAYER_KEYS:
            if rest.startswith(a):
                return f"{base}encoder.layer.{i}.{b}{rest[len(a):]}"
    for a, b in _EMBEDDING_KEYS:
        if ours.startswith(a):
            return base + b + ours[len(a):]
    for a, b in _HEAD_KEYS[family]:
        if ours.startswith(a):
            return b + ours[len(a):]
    raise InteropError(f"parameter {ours} has no {family} equivalent")


# ---------------------------------------------------------------------------------------------------------
# Export
def input_length(mc: ModelConfig, input_len: Optional[int] = None) -> int:
    """The input length the export is for: a GLUE run's --max-seq-len when shorter than the position table (its
    inputs were padded to that many tokens), else the model's max_seq_len."""
    return input_len if input_len is not None and input_len < mc.max_seq_len else mc.max_seq_len


def check_exportable(mc: ModelConfig, input_len: Optional[int] = None) -> List[str]:
    """Raise InteropError naming the first option transformers cannot reproduce; return notes on options
    that do not change the computation (to print). ``input_len``: see ``input_length``."""
    notes = []
    if mc.attn_type not in ("nystrom", "softmax"):
        raise InteropError(f"model.attn_type: {mc.attn_type!r} has no transformers Nystromformer equivalent "
                           f"(exportable: nystrom, softmax)")
    n = input_length(mc, input_len)
    exact = mc.attn_type == "softmax" or mc.num_landmarks >= n
    if mc.pre_layer_norm:
        raise InteropError("model.pre_layer_norm: transformers' Nystromformer is post-LayerNorm")
    if mc.embedding_dim != mc.transformer_dim:
        raise InteropError(f"model.embedding_dim ({mc.embedding_dim}) != model.transformer_dim "
                           f"({mc.transformer_dim}): transformers' Nystromformer has no embedding projection "
                           f"(its embeddings and MLM head have width hidden_size)")
    if not exact:
        if n % mc.num_landmarks:
            length = "max_seq_len" if n == mc.max_seq_len else "the GLUE run's --max-seq-len"
            raise InteropError(
                f"model.num_landmarks: {length} {n} is not a multiple of num_landmarks "
                f"{mc.num_landmarks}; our uneven segment means have no transformers equivalent (its segment "
                f"means reshape segment_means_seq_len into num_landmarks equal segments)")
        if mc.inv_coeff_init_option == "exact":
            raise InteropError(
                "model.inv_coeff_init_option: 'exact' has no working transformers equivalent (its "
                "inv_coeff_init_option=True reads config['inv_init_coeff_option'] and crashes at construction)")
        if mc.pinv_iterations != HF_PINV_ITERATIONS:
            raise InteropError(f"model.pinv_iterations: {mc.pinv_iterations}; transformers always runs "
                               f"{HF_PINV_ITERATIONS} pseudo-inverse iterations")
    else:
        if mc.attn_type == "nystrom" and (mc.inv_coeff_init_option != "original"
                                          or mc.pinv_iterations != HF_PINV_ITERATIONS):
            notes.append("inv_coeff_init_option/pinv_iterations are unused (num_landmarks >= max_seq_len: "
                         "exact softmax), exported as transformers' defaults")
    if mc.attention_fp32:
        notes.append("attention_fp32 has no transformers equivalent: identical in fp32; under autocast "
                     "transformers computes attention in the autocast dtype")
    if not exact:
        notes.append(f"transformers' Nystrom path accepts only unpadded inputs of exactly {n} "
                     f"tokens (segment_means_seq_len); shorter inputs crash or mix batch rows, padding masks "
                     f"crash, and it runs only in fp32 (bf16/fp16 raise a dtype error; see docs/interop.md)")
    return notes


def hf_config_kwargs(mc: ModelConfig, special_tokens: Optional[Dict[str, int]] = None,
                     input_len: Optional[int] = None) -> dict:
    """NystromformerConfig arguments computing what our ``mc`` computes on inputs of ``input_length`` tokens."""
    n = input_length(mc, input_len)
    exact = mc.attn_type == "softmax" or mc.num_landmarks >= n
    special = special_tokens or {}
    return dict(
        vocab_size=mc.vocab_size, hidden_size=mc.transformer_dim, num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_head, intermediate_size=mc.transformer_hidden_dim,
        hidden_act=HF_ACTIVATION[mc.hidden_act],
        hidden_dropout_prob=mc.dropout_prob, attention_probs_dropout_prob=mc.dropout_prob,  # (unused there)
        # transformers' table has max_position_embeddings + 2 rows, positions 2..n+1: as ours.
        max_position_embeddings=mc.max_seq_len, type_vocab_size=mc.num_sen_type,
        # transformers takes its exact softmax path only when num_landmarks == segment_means_seq_len.
        segment_means_seq_len=n, num_landmarks=n if exact else mc.num_landmarks,
        # transformers 5 rejects conv_kernel_size=None: "no conv" is exported as a zero 1x1 conv.
        conv_kernel_size=mc.conv_kernel_size if (mc.conv_kernel_size and mc.attn_type == "nystrom") else 1,
        inv_coeff_init_option=False, layer_norm_eps=mc.layer_norm_eps, pad_token_id=mc.pad_token_id,
        bos_token_id=special.get("bos", 0), eos_token_id=special.get("eos", 2), tie_word_embeddings=True,
    )


def to_hf_state_dict(state: Dict[str, torch.Tensor], mc: ModelConfig) -> Dict[str, torch.Tensor]:
    out = {hf_key(k): v for k, v in state.items()}
    if mc.conv_kernel_size is None or mc.attn_type != "nystrom":
        for i in range(mc.num_layers):
            out[f"nystromformer.encoder.layer.{i}.attention.self.conv.weight"] = torch.zeros(mc.num_head, 1, 1, 1)
    if "cls.predictions.bias" in out:  # tied in transformers; give them explicitly so loading is strict
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
        out["cls.predictions.decoder.weight"] = out["nystromformer.embeddings.word_embeddings.weight"]
    return out


def build_hf_model(mc: ModelConfig, state: Dict[str, torch.Tensor], num_labels: Optional[int] = None,
                   special_tokens: Optional[Dict[str, int]] = None, label_names: Optional[List[str]] = None,
                   input_len: Optional[int] = None):
    """A transformers NystromformerForMaskedLM (or ...ForSequenceClassification when ``num_labels``, with
    ``label_names`` as its id2label) holding our weights ``state``."""
    import transformers

    kwargs = hf_config_kwargs(mc, special_tokens, input_len)
    if num_labels is not None:
        kwargs["num_labels"] = num_labels
        if label_names and len(label_names) == num_labels:
            kwargs["id2label"] = dict(enumerate(label_names))
            kwargs["label2id"] = {name: i for i, name in enumerate(label_names)}
        kwargs["problem_type"] = "regression" if num_labels == 1 else "single_label_classification"
        cls = transformers.NystromformerForSequenceClassification
    else:
        cls = transformers.NystromformerForMaskedLM
    config = transformers.NystromformerConfig(**kwargs)
    config.architectures = [cls.__name__]
    model = cls(config)
    result = model.load_state_dict(to_hf_state_dict(state, mc), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise InteropError(f"weights do not fit transformers' {cls.__name__}: missing {result.missing_keys}, "
                           f"unexpected {result.unexpected_keys}")
    return model.eval()


def _special_tokens(cfg: Config) -> Dict[str, int]:
    try:
        return dict(read_meta(cfg.data_dir)["special_tokens"])
    except ShardError:  # no data folder here: transformers' defaults
        return {}


def glue_input_length(obj: dict) -> Optional[int]:
    """The --max-seq-len a GLUE best.model records it was fine-tuned with (None: the model's own, or none)."""
    settings = obj.get("settings")
    value = settings.get("max_seq_len") if isinstance(settings, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def load_glue_weights(path: PathLike, cfg: Config) -> Tuple[Dict[str, torch.Tensor], ModelConfig, int,
                                                             Optional[List[str]], Optional[int]]:
    """(state dict, model config, num_labels, label names, input length) of a fine-tuned
    NystromformerForSequenceClassification file (label names from its GLUE task, when it records one; the input
    length from its run's --max-seq-len, when shorter runs recorded one)."""
    obj = checkpoint.load(path)
    state = obj["model_state_dict"]
    bad = [k for k in state if not k.startswith(("encoder.", "classifier."))]
    if bad or "classifier.out_proj.weight" not in state:
        raise InteropError(f"{path}: not sequence-classification weights (expected encoder.* and classifier.* "
                           f"keys; found {bad[:1] or 'no classifier.out_proj.weight'})")
    if isinstance(obj.get("model_config"), dict):
        mc = config_from_dict({"model": as_recorded("model", obj["model_config"])}).model
    else:  # the fine-tuning run may have tiled positions beyond the pretraining length
        rows = state[checkpoint.POSITION_KEY].shape[0] - POSITION_OFFSET
        mc = dataclasses.replace(cfg.model, max_seq_len=rows)
    from .glue.tasks import TASKS
    task = TASKS.get(obj.get("task")) if isinstance(obj.get("task"), str) else None
    return (state, mc, int(state["classifier.out_proj.weight"].shape[0]), task.labels if task else None,
            glue_input_length(obj))


def _trained_model_config(saved: dict, cfg: Config, source: Path, log) -> ModelConfig:
    """The model settings a checkpoint was trained with (stored in it since pretraining records its config),
    else config.json's."""
    stored = (saved.get("config") or {}).get("model") if isinstance(saved.get("config"), dict) else None
    if not isinstance(stored, dict):
        return cfg.model
    try:
        trained = config_from_dict({"model": as_recorded("model", stored)}).model
    except ConfigError as e:
        log(f"note: {source} records model settings this version does not accept ({e}); exporting with "
            f"config.json's model settings")
        return cfg.model
    differ = [f.name for f in dataclasses.fields(ModelConfig) if getattr(trained, f.name) != getattr(cfg.model, f.name)]
    if differ:
        log(f"note: {source.name} was trained with other model settings than config.json now has ("
            + ", ".join(f"{k} {getattr(trained, k)!r} instead of {getattr(cfg.model, k)!r}" for k in differ)
            + "); exporting it as trained")
    return trained


def _check_weights_fit(state: Dict[str, torch.Tensor], mc: ModelConfig, num_labels: Optional[int],
                       source: Path) -> None:
    """Refuse, naming the first weight, a checkpoint that the model settings do not describe (rather than export
    a model that computes something else)."""
    with torch.device("meta"):  # shapes only: no memory, no initialisation work
        model = (NystromformerForMaskedLM(mc) if num_labels is None
                 else NystromformerForSequenceClassification(mc, num_labels))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    for key in sorted(expected.keys() | found.keys()):
        if expected.get(key) != found.get(key):
            what = ("not in the checkpoint" if key not in found else "not in the model" if key not in expected
                    else f"shape {found[key]} in the checkpoint, {expected[key]} in the model")
            raise InteropError(f"{source}: {key}: {what}; the model settings (max_seq_len {mc.max_seq_len}, "
                               f"conv_kernel_size {mc.conv_kernel_size}, vocab_size {mc.vocab_size}, num_layers "
                               f"{mc.num_layers}...) do not describe this checkpoint")


def export_hf(cfg: Config, output: PathLike, epoch: Optional[int] = None, glue_weights: Optional[PathLike] = None,
              num_labels: Optional[int] = None, log: Callable[[str], None] = say, overwrite: bool = False) -> Path:
    """Write a folder that ``transformers.AutoModelFor...from_pretrained`` loads: config.json, safetensors
    weights and (when the model folder names one) the tokenizer. ``output`` must be new or empty, or (with
    ``overwrite``) a previous export, which is replaced as a whole."""
    output = Path(output).resolve()  # a link to a folder: the folder is replaced, not the link
    if glue_weights is not None and epoch is not None:
        raise InteropError("give --checkpoint N (a pretraining checkpoint) or --glue-weights PATH, not both")
    if glue_weights is None and num_labels is not None:
        raise InteropError("--num-labels checks a classifier: it applies with --glue-weights only")
    _remove_stale_staging(output, log)
    check_export_output(output, overwrite)
    check_tokenizer_is_the_datas(cfg)  # a retrained tokenizer would be exported beside weights of other ids
    if glue_weights is not None:
        state, mc, found, label_names, input_len = load_glue_weights(glue_weights, cfg)
        if num_labels is not None and num_labels != found:
            raise InteropError(f"--num-labels {num_labels}, but {glue_weights} has a {found}-label classifier")
        num_labels = found
        source = Path(glue_weights)
    else:
        if epoch is None:
            raise InteropError("give --checkpoint N (cp-N.model) or --glue-weights PATH")
        source = checkpoint.find_model(cfg.checkpoint_dir, epoch)
        saved = checkpoint.load(source)
        state, mc, num_labels = saved["model_state_dict"], _trained_model_config(saved, cfg, source, log), None
        label_names, input_len = None, None
    _check_weights_fit(state, mc, num_labels, source)
    for note in check_exportable(mc, input_len):
        log(f"note: {note}")
    model = build_hf_model(mc, state, num_labels, _special_tokens(cfg), label_names, input_len)
    # Written into a new folder beside the output, then renamed into place: an export that fails half-way leaves
    # the old folder as it was, and an overwritten one keeps no file of the previous export.
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=STAGING_SUFFIX, dir=output.parent))
    try:
        model.save_pretrained(str(staging))  # safetensors
        try:
            tokenizer = model_tokenizer(cfg)
            tok = load_tokenizer(tokenizer)
        except (ConfigError, TokenizerError) as e:
            log(f"warning: no tokenizer found ({e}): exported the weights only; copy the tokenizer files into the "
                f"folder before using pipeline()")
        else:
            tok.model_max_length = input_length(mc, input_len)
            tok.save_pretrained(str(staging))
            for name in TOKENIZER_FILES:  # also the source files (vocab.json, merges.txt) for other readers
                if isinstance(tokenizer, Path) and (tokenizer / name).is_file() and not (staging / name).exists():
                    shutil.copyfile(tokenizer / name, staging / name)
        # mkdtemp makes the folder 0700 and transformers writes model.safetensors 0600: the umask's modes instead
        umask = atomic.current_umask()
        staging.chmod(0o777 & ~umask)
        for path in staging.iterdir():
            if path.is_file():
                path.chmod(0o666 & ~umask)
        aside = staging.with_name(staging.name + ".old")
        atomic.swap_folder(staging, output, aside)
        if aside.exists():
            shutil.rmtree(aside)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    log(f"exported {source} as transformers {model.__class__.__name__} to {output}")
    return output


def check_export_output(output: Path, overwrite: bool) -> None:
    """The export's folder: new or empty; a previous export only with ``overwrite``; never anything else (a model
    folder of this project, data): the export replaces the whole folder."""
    if not output.exists():
        atomic.check_writable_folder(output, "--output")
        return
    if not output.is_dir():
        raise InteropError(f"--output {output}: is a file; give a folder to write")
    atomic.check_writable_folder(output.parent, "--output")
    if not any(output.iterdir()):
        return
    config = output / "config.json"
    try:
        exported = "model_type" in json.loads(config.read_text())
    except (OSError, ValueError, TypeError):
        exported = False
    if not exported:
        raise InteropError(f"--output {output}: holds files and is not a transformers model folder (no config.json "
                           f"with a model_type); the export replaces the whole folder: give a new or empty one")
    if not overwrite:
        raise InteropError(f"--output {output}: holds a transformers model already; give --overwrite to replace "
                           f"it (every file in it), or another folder")


def _remove_stale_staging(output: Path, log: Callable[[str], None]) -> None:
    """Folders an export killed mid-way left beside ``output``: a half-written new export (removed), or the
    previous export moved aside just before the new one was renamed in (put back when ``output`` is missing)."""
    # mkdtemp's random part has no dot: ".hf.<random>.export-staging" is hf's, ".hf.v2.<random>..." hf.v2's.
    own = re.compile(rf"\.{re.escape(output.name)}\.[a-z0-9_]+{re.escape(STAGING_SUFFIX)}(\.old)?")
    for path in sorted(output.parent.glob(f".{glob.escape(output.name)}.*{STAGING_SUFFIX}*")):
        if not path.is_dir() or not own.fullmatch(path.name):
            continue
        if path.name.endswith(".old") and not output.exists():
            log(f"note: restoring {output} from {path.name} (an export killed while replacing it)")
            path.rename(output)
        else:
            log(f"note: removing {path} (left by an export that was killed)")
            shutil.rmtree(path)


# ---------------------------------------------------------------------------------------------------------
# Import
def read_hf_folder(folder: PathLike) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(config.json dict, state dict) of a transformers model folder: safetensors or pytorch_model.bin, single or
    sharded, read without instantiating the model. Keys the config.json leaves out take transformers' defaults
    for its model_type, as from_pretrained would."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InteropError(f"{folder}: not a folder (give a transformers model folder)")
    if not (folder / "config.json").is_file():
        raise InteropError(f"{folder}: no config.json (is it a transformers model folder?)")
    try:
        hf_cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InteropError(f"{folder / 'config.json'}: unreadable ({e})") from None
    if not isinstance(hf_cfg, dict):
        raise InteropError(f"{folder / 'config.json'}: not a JSON object")
    if "model" in hf_cfg and "model_type" not in hf_cfg:
        raise InteropError(f"{folder}: a model folder of this project, not a transformers folder (import-hf reads "
                           f"what transformers' save_pretrained writes; this one needs no import: use it as it is, "
                           f"or point from_cp at its checkpoint)")
    hf_cfg = {**_transformers_defaults(hf_cfg.get("model_type")), **hf_cfg}
    missing = [k for k in HF_REQUIRED_KEYS if k not in hf_cfg]
    if missing:
        raise InteropError(f"{folder / 'config.json'}: no {', '.join(missing)}")

    def load(file: Path) -> Dict[str, torch.Tensor]:
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file
                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # safetensors' own error type, pickle's, OSError...: name the file
            raise InteropError(f"{file}: unreadable weights ({type(e).__name__}: {e})") from None

    state: Dict[str, torch.Tensor] = {}
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (folder / single).is_file():
            return hf_cfg, load(folder / single)
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as e:
                raise InteropError(f"{folder / index}: unreadable shard index ({e})") from None
            for shard in shards:
                state.update(load(folder / shard))
            return hf_cfg, state
    raise InteropError(f"{folder}: no model.safetensors or pytorch_model.bin (single or sharded)")


def _transformers_defaults(model_type) -> dict:
    """transformers' default config values for ``model_type`` (empty for an unknown type)."""
    import transformers

    try:
        return transformers.AutoConfig.for_model(model_type).to_dict()
    except (ValueError, TypeError):
        return {}


# Our model.hidden_act as transformers names it, and transformers' names for the two GELUs (gelu_new,
# gelu_pytorch_tanh and gelu_fast all compute the tanh approximation).
HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
FROM_HF_ACTIVATION = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                      "gelu": "gelu"}


def _hidden_act(hf_cfg: dict) -> str:
    """Our model.hidden_act for a transformers config's hidden_act."""
    act = hf_cfg.get("hidden_act", "gelu")
    if act not in FROM_HF_ACTIVATION:
        raise InteropError(f"hidden_act: {act!r} has no equivalent here (our models have the exact GELU or its "
                           f"tanh approximation: {', '.join(sorted(FROM_HF_ACTIVATION))})")
    return FROM_HF_ACTIVATION[act]


def model_config_from_hf(hf_cfg: dict, base: Optional[ModelConfig] = None, match_transformers: bool = False,
                         log: Callable[[str], None] = say) -> ModelConfig:
    """Our ModelConfig for a transformers NystromformerConfig dict. ``base`` supplies our options without a
    transformers counterpart (mixed precision, checkpointing...)."""
    base = base or ModelConfig()
    hidden_act = _hidden_act(hf_cfg)
    hidden, heads = hf_cfg["hidden_size"], hf_cfg["num_attention_heads"]
    max_len = hf_cfg["max_position_embeddings"]
    m, seg = hf_cfg.get("num_landmarks", 64), hf_cfg.get("segment_means_seq_len", 64)
    if m == seg and seg < max_len:
        # The released uw-madison/nystromformer-512 config: segment_means_seq_len 64 (= num_landmarks) where the
        # sequence length (512) was meant, so transformers runs it with exact softmax attention.
        if match_transformers:
            log(f"note: num_landmarks == segment_means_seq_len == {m} < max_position_embeddings {max_len}: "
                f"transformers computes exact softmax attention; importing as such (num_landmarks = max_seq_len)")
            num_landmarks = max_len
        else:
            log(f"note: num_landmarks == segment_means_seq_len == {m} < max_position_embeddings {max_len}: the "
                f"swapped keys of the released config (segment_means_seq_len should be the sequence length). "
                f"transformers therefore computes exact softmax attention, but the model was pretrained with "
                f"{m} Nystrom landmarks: importing num_landmarks={m} (pass --match-transformers for exact "
                f"softmax, as transformers computes)")
            num_landmarks = m
    elif m == seg:
        num_landmarks = max_len  # transformers' exact path: our num_landmarks >= max_seq_len is exact too
    else:
        if seg != max_len:
            log(f"warning: segment_means_seq_len {seg} != max_position_embeddings {max_len}: transformers only "
                f"accepts inputs of {seg} tokens; importing max_seq_len {max_len}")
        num_landmarks = m
    kernel = hf_cfg.get("conv_kernel_size", 65)
    return dataclasses.replace(
        base, vocab_size=hf_cfg["vocab_size"], num_sen_type=hf_cfg.get("type_vocab_size", 2), max_seq_len=max_len,
        embedding_dim=hidden, transformer_dim=hidden, transformer_hidden_dim=hf_cfg["intermediate_size"],
        num_layers=hf_cfg["num_hidden_layers"], dropout_prob=hf_cfg.get("hidden_dropout_prob", 0.1),
        num_head=heads, head_dim=hidden // heads, attn_type="nystrom", num_landmarks=num_landmarks,
        conv_kernel_size=kernel, inv_coeff_init_option="exact" if hf_cfg.get("inv_coeff_init_option") else "original",
        pinv_iterations=HF_PINV_ITERATIONS, layer_norm_eps=hf_cfg.get("layer_norm_eps", 1e-5),
        pad_token_id=hf_cfg.get("pad_token_id", 1) if hf_cfg.get("pad_token_id") is not None else 1,
        hidden_act=hidden_act, pre_layer_norm=False)  # transformers' Nystromformer is post-LayerNorm


def model_config_from_roberta(hf_cfg: dict, base: ModelConfig, log: Callable[[str], None] = say) -> ModelConfig:
    """Our ModelConfig for RoBERTa weights: dimensions from RoBERTa; attention type, landmarks, conv and
    max_seq_len from ``base`` (our config.json / flags)."""
    hidden_act = _hidden_act(hf_cfg)
    hidden, heads = hf_cfg["hidden_size"], hf_cfg["num_attention_heads"]
    return dataclasses.replace(
        base, vocab_size=hf_cfg["vocab_size"], num_sen_type=hf_cfg.get("type_vocab_size", 1), hidden_act=hidden_act,
        embedding_dim=hidden, transformer_dim=hidden, transformer_hidden_dim=hf_cfg["intermediate_size"],
        num_layers=hf_cfg["num_hidden_layers"], dropout_prob=hf_cfg.get("hidden_dropout_prob", 0.1),
        num_head=heads, head_dim=hidden // heads, layer_norm_eps=hf_cfg.get("layer_norm_eps", 1e-5),
        pad_token_id=1 if hf_cfg.get("pad_token_id") is None else hf_cfg["pad_token_id"],
        pre_layer_norm=False)  # RoBERTa is post-LayerNorm


def _from_roberta_positions(table: torch.Tensor, pad_token_id: int, log: Callable[[str], None]) -> torch.Tensor:
    """RoBERTa numbers a sequence's positions from pad_token_id + 1 (2 with its usual pad id 1); ours from
    POSITION_OFFSET whatever the pad id: RoBERTa's rows moved so that our first position reads its first's."""
    first = pad_token_id + 1
    if first == POSITION_OFFSET:
        return table
    log(f"note: RoBERTa's positions start at row {first} (pad_token_id {pad_token_id} + 1); moved to row "
        f"{POSITION_OFFSET}, where this model's positions start")
    return torch.cat([table.new_zeros(POSITION_OFFSET, table.shape[1]), table[first:]])  # rows below: never used


def roberta_length(hf_cfg: dict) -> int:
    """The positions a RoBERTa model has: those after its pad_token_id."""
    pad = hf_cfg.get("pad_token_id")
    return hf_cfg["max_position_embeddings"] - ((1 if pad is None else pad) + 1)


def from_hf_state_dict(hf_state: Dict[str, torch.Tensor], mc: ModelConfig, family: str,
                       log: Callable[[str], None] = say) -> Dict[str, torch.Tensor]:
    """Our full MLM state dict: mapped weights where transformers has them, our initialisation elsewhere
    (reported). A zero 1x1 conv (our export of "no conv") is dropped when ``mc`` has no conv."""
    model = NystromformerForMaskedLM(mc)
    own = model.state_dict()
    raw_keys = list(hf_state)
    # A bare NystromformerModel/RobertaModel is saved without the family prefix.
    if not any(k.startswith(f"{family}.") for k in hf_state):
        hf_state = {f"{family}.{k}" if not k.startswith(("cls.", "lm_head.", "classifier.")) else k: v
                    for k, v in hf_state.items()}
    _check_tied_decoder(hf_state, family)
    out, missing, unmapped, used = {}, [], [], set()
    for k, v in own.items():
        try:
            name = hf_key(k, family)
        except InteropError:  # a parameter of another attention type (e.g. Linformer's projections)
            name = None
            unmapped.append(k)
        if name in hf_state:
            w = hf_state[name]
            if k == checkpoint.POSITION_KEY and family == "roberta":
                w = _from_roberta_positions(w, mc.pad_token_id, log)
            if k == checkpoint.POSITION_KEY and w.shape[0] > v.shape[0]:
                w = w[:v.shape[0]]  # positions 2..max_seq_len+1 use the first rows only
            elif k == checkpoint.POSITION_KEY and w.shape[0] < v.shape[0]:
                w = checkpoint.extend_position_embeddings({k: w}, mc.max_seq_len)[k]
            if w.shape != v.shape:
                hint = ""
                if k.endswith("attn.conv.weight"):  # typically a --conv-kernel-size other than the weights'
                    hint = (f" (model.conv_kernel_size {mc.conv_kernel_size}, but the weights' conv kernel is "
                            f"{w.shape[2]}: a different size cannot reuse them)")
                raise InteropError(f"{name} has shape {tuple(w.shape)}, our {k} expects {tuple(v.shape)}{hint}")
            out[k] = w.to(v.dtype).clone()
            used.add(name)
        else:
            out[k] = v
            missing.append(k)
    unused = [k for k in hf_state if k not in used and not k.endswith(("position_ids", "token_type_ids"))
              and not k.startswith(("cls.predictions.decoder.", "lm_head.decoder."))]
    dropped_conv = [k for k in unused if k.endswith("attention.self.conv.weight") and not hf_state[k].any()]
    unused = [k for k in unused if k not in dropped_conv]
    # Only what transformers' model lacks may stay at our initialisation: the MLM head of a bare or classification
    # model, RoBERTa's conv, another attention type's parameters. A missing encoder weight means other weights.
    expected_missing = [k for k in missing if k in unmapped or k.startswith("mlm_head.")
                        or (family == "roberta" and ".attention.attn." in k)]
    lost = [k for k in missing if k not in expected_missing]
    if lost:
        wrapped = sorted({p for k in raw_keys for p in WRAPPER_PREFIXES if k.startswith(p)})
        raise InteropError(
            f"{len(lost)} encoder weight(s) are not in the transformers weights, e.g. {hf_key(lost[0], family)} "
            f"(for our {lost[0]}): importing would leave them random"
            + (f"; its keys start with {' and '.join(wrapped)}: saved from a wrapped model (DDP, torch.compile) "
               f"rather than with save_pretrained" if wrapped else ""))
    if expected_missing:
        log(f"warning: not in the transformers weights (left at our initialisation): {', '.join(expected_missing)}")
    if unused:
        log(f"transformers weights not used: {', '.join(unused)}")
    return out


def _check_tied_decoder(hf_state: Dict[str, torch.Tensor], family: str) -> None:
    """Our MLM decoder is the word embeddings (and the head's bias): refuse a checkpoint whose decoder is not."""
    head = "cls.predictions" if family == "nystromformer" else "lm_head"
    embeddings = hf_state.get(f"{family}.embeddings.word_embeddings.weight",
                              hf_state.get("embeddings.word_embeddings.weight"))
    pairs = ((f"{head}.decoder.weight", embeddings, "the word embeddings"),
             (f"{head}.decoder.bias", hf_state.get(f"{head}.bias"), f"{head}.bias"))
    for name, tied, what in pairs:
        decoder = hf_state.get(name)
        if decoder is not None and tied is not None and not torch.equal(decoder, tied):
            raise InteropError(f"{name} differs from {what}: the checkpoint was trained with tie_word_embeddings "
                               f"false, and our MLM head shares the word embeddings (it would be another model)")


def _existing_config(model_dir: Path) -> dict:
    """The model folder's config.json as a dict ({} when there is none yet)."""
    path = model_dir / "config.json"
    if not path.is_file():
        return {}
    data = read_config_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("model", {}), dict):
        raise ConfigError(f"{path}: expected a JSON object (with a \"model\" object)")
    return data


# Our model keys and the transformers config keys they are read from (model_config_from_hf / _from_roberta)
HF_KEY_OF = {"vocab_size": "vocab_size", "num_sen_type": "type_vocab_size", "max_seq_len": "max_position_embeddings",
             "embedding_dim": "hidden_size", "transformer_dim": "hidden_size", "head_dim": "hidden_size",
             "transformer_hidden_dim": "intermediate_size", "num_layers": "num_hidden_layers",
             "dropout_prob": "hidden_dropout_prob", "num_head": "num_attention_heads",
             "num_landmarks": "num_landmarks", "conv_kernel_size": "conv_kernel_size",
             "layer_norm_eps": "layer_norm_eps", "pad_token_id": "pad_token_id"}


def _validated(build: Callable[[], Config], source: Path, overrides: Optional[dict], hf: bool = False) -> Config:
    """``build()``, with a ConfigError named by the flag that set the key, else by ``source`` (the config.json the
    other values came from; with ``hf``, a transformers config.json, named by its own key)."""
    try:
        return build()
    except ConfigError as e:
        key = (e.key or "").removeprefix("model.")
        if key in (overrides or {}):
            raise InteropError(f"--{key.replace('_', '-')} {overrides[key]}: {e.reason}") from None
        if hf and key in HF_KEY_OF:
            raise ConfigError(f"{source}: {HF_KEY_OF[key]} (read as model.{key}): {e.reason}") from None
        raise ConfigError(f"{source}: {e}") from None


def import_hf(input_dir: PathLike, model_dir: PathLike, match_transformers: bool = False,
              overrides: Optional[dict] = None, force: bool = False, log: Callable[[str], None] = say) -> Path:
    """Write ``<model_dir>/imported/hf-import.model`` from a transformers Nyströmformer or RoBERTa folder, and
    config.json with the model section and ``from_cp`` pointing at it (other keys kept or defaulted)."""
    model_dir = Path(model_dir)
    if model_dir.exists() and not model_dir.is_dir():
        raise InteropError(f"--model-dir {model_dir}: is a file, not a model folder")
    existing = _existing_config(model_dir)
    base_cfg = _validated(lambda: config_from_dict({**existing, "model": {**existing.get("model", {}),
                                                                         **(overrides or {})}}, model_dir),
                          model_dir / "config.json", overrides)
    hf_cfg, hf_state = read_hf_folder(input_dir)
    family = hf_cfg.get("model_type")
    if base_cfg.model.pre_layer_norm:
        log(f"note: {model_dir / 'config.json'} has model.pre_layer_norm true; the imported weights are of a "
            f"post-LayerNorm model: importing with pre_layer_norm false")
    if family == "nystromformer":
        mc = model_config_from_hf(hf_cfg, base_cfg.model, match_transformers, log)
        convs = [v for k, v in hf_state.items() if k.endswith("attention.self.conv.weight")]
        if mc.conv_kernel_size == 1 and convs and not any(c.any() for c in convs):
            mc = dataclasses.replace(mc, conv_kernel_size=None)  # our export of "no conv"
        # explicit flags win over the transformers config (e.g. a different attention for continued training)
        exact = mc.num_landmarks >= mc.max_seq_len
        mc = dataclasses.replace(mc, **(overrides or {}))
        if exact and "num_landmarks" not in (overrides or {}) and mc.num_landmarks < mc.max_seq_len:
            # A longer max_seq_len alone must not turn exact attention into Nystrom with that many landmarks.
            log(f"note: the transformers model computes exact softmax attention (num_landmarks == "
                f"segment_means_seq_len); keeping it exact at max_seq_len {mc.max_seq_len} (num_landmarks "
                f"{mc.max_seq_len}); give --num-landmarks for Nystrom attention")
            mc = dataclasses.replace(mc, num_landmarks=mc.max_seq_len)
    elif family in ("roberta", "xlm-roberta"):
        family = "roberta"
        mc = model_config_from_roberta(hf_cfg, base_cfg.model, log)
        roberta_len = roberta_length(hf_cfg)
        if mc.max_seq_len % roberta_len and mc.max_seq_len > roberta_len:
            raise InteropError(f"model.max_seq_len {mc.max_seq_len} must be a multiple of RoBERTa's length "
                               f"{roberta_len} (or at most it) to tile its position embeddings")
    else:
        raise InteropError(f"{input_dir}: model_type {family!r}; import-hf reads nystromformer or roberta folders")
    data = {**existing, "model": dataclasses.asdict(mc)}
    cfg = _validated(lambda: config_from_dict(data, model_dir), Path(input_dir) / "config.json", overrides, hf=True)
    state = from_hf_state_dict(hf_state, mc, family, log)
    if checkpoint.resumable_checkpoints(cfg.checkpoint_dir, cfg.pretraining_setting.batches_per_epoch) and not force:
        raise InteropError(f"{cfg.checkpoint_dir} already has resumable checkpoints: pretraining would resume "
                           f"from them and ignore from_cp (use another --model-dir, or --force)")
    target = model_dir / IMPORTED_WEIGHTS
    atomic.torch_save(target, {"model_state_dict": state, "epoch": -1, "step": 0,
                               "config": cfg.to_dict(), "source": str(Path(input_dir).resolve())})
    data["from_cp"] = IMPORTED_WEIGHTS
    atomic.write_json(model_dir / "config.json", data)
    log(f"imported {input_dir} ({family}) to {target}; config.json from_cp = {IMPORTED_WEIGHTS}")
    return target


# ---------------------------------------------------------------------------------------------------------
# Commands
EXPORT_DOC = """Export a checkpoint as a transformers Nystromformer folder (config.json, model.safetensors, tokenizer).

    nystromformer export-hf --model-dir nystrom-512 --checkpoint 9 --output hf-nystrom-512
    nystromformer export-hf --model-dir nystrom-512 --glue-weights PATH/best.model --output hf-sst2

Refuses, naming the option, a model that transformers would compute differently (docs/interop.md)."""

IMPORT_DOC = """Import transformers Nystromformer or RoBERTa weights as a warm start for pretraining/fine-tuning.

Writes <model-dir>/imported/hf-import.model and config.json (model section from the transformers config,
other keys kept when config.json exists) with from_cp pointing at the imported weights.

    nystromformer import-hf --input nystromformer-512 --model-dir nystrom-512-continued
    nystromformer import-hf --input roberta-base --model-dir nystrom-4096 --max-seq-len 4096 --num-landmarks 64"""


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=".", help="model folder holding config.json (default: current directory)")
    p.add_argument("--checkpoint", type=int, default=None, help="epoch N of cp-N.model to export")
    p.add_argument("--glue-weights", default=None,
                   help="fine-tuned sequence-classification weights (a file with model_state_dict) to export "
                        "as NystromformerForSequenceClassification")
    p.add_argument("--num-labels", type=int, default=None, help="expected number of labels (checked)")
    p.add_argument("--output", required=True, help="folder to write (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous export in --output (every file)")


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="transformers folder (Nystromformer or RoBERTa)")
    p.add_argument("--model-dir", required=True, help="our model folder to write (config.json kept if present)")
    p.add_argument("--match-transformers", action="store_true",
                   help="for configs with num_landmarks == segment_means_seq_len (e.g. the released "
                        "nystromformer-512): compute exact softmax, as transformers does")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="model.max_seq_len (longer: positions are tiled; shorter: the table is cut)")
    p.add_argument("--attn-type", choices=("nystrom", "softmax"), default=None)
    p.add_argument("--num-landmarks", type=int, default=None)
    p.add_argument("--conv-kernel-size", type=int, default=None)
    p.add_argument("--force", action="store_true", help="import even if the folder has resumable checkpoints")


def run_export(args: argparse.Namespace) -> int:
    export_hf(load_config(args.model_dir), args.output, args.checkpoint, args.glue_weights, args.num_labels,
              overwrite=args.overwrite)
    return 0


def run_import(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("max_seq_len", args.max_seq_len), ("attn_type", args.attn_type),
                                   ("num_landmarks", args.num_landmarks),
                                   ("conv_kernel_size", args.conv_kernel_size)) if v is not None}
    import_hf(args.input, args.model_dir, args.match_transformers, overrides, args.force)
    return 0


def add_commands(subparsers) -> None:
    add_subcommand(subparsers, "export-hf", "export a checkpoint as a transformers Nystromformer folder",
                   EXPORT_DOC, add_export_arguments, run_export)
    add_subcommand(subparsers, "import-hf", "import transformers Nystromformer/RoBERTa weights (warm start)",
                   IMPORT_DOC, add_import_arguments, run_import)
