"""Tokenizer loading: one function for pretrained folders (RoBERTa's vocab.json + merges.txt, or a
``tokenizer.json``) and for the byte-level BPE that ``nystromformer train-tokenizer`` writes."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, Optional, Union

from .cli import say
from .errors import UserError

# A tokenizer folder's files (this order: data/build.py's tokenizer fingerprint hashes them in it).
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "added_tokens.json", "special_tokens_map.json",
                   "tokenizer_config.json")
SPECIAL_TOKEN_ATTRS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "pad_token_id",
                       "mask": "mask_token_id", "unk": "unk_token_id"}


class TokenizerError(UserError, ValueError):
    pass


def load_tokenizer(name_or_path: Union[str, Path]):
    """A transformers fast tokenizer from a folder (preferred: no network) or a cached hub name."""
    from transformers import PreTrainedTokenizerFast, RobertaTokenizerFast

    path = Path(name_or_path)
    if path.is_dir():
        try:
            if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
                return RobertaTokenizerFast.from_pretrained(str(path))
            if (path / "tokenizer.json").is_file():
                return PreTrainedTokenizerFast.from_pretrained(str(path))
        except Exception as e:  # the libraries' errors do not say which folder
            raise TokenizerError(f"{path}: unreadable tokenizer files ({type(e).__name__}: {e})") from None
        raise TokenizerError(f"{path}: no tokenizer files (expected vocab.json + merges.txt, or tokenizer.json)")
    help = ("Offline machines: put the tokenizer files (vocab.json, merges.txt) in a folder and pass its path, or "
            "train one with `nystromformer train-tokenizer`.")
    text = str(name_or_path)
    if path.is_absolute() or text.startswith(("./", "../", "~")) or path.exists():  # a path, not a hub name
        raise TokenizerError(f"tokenizer {text!r}: " + ("not a folder" if path.exists() else "no such folder"))
    try:
        tokenizer = RobertaTokenizerFast.from_pretrained(str(name_or_path), local_files_only=True)
    except Exception as e:
        raise TokenizerError(f"tokenizer {str(name_or_path)!r} is neither a folder nor in the local Hugging Face "
                             f"cache ({e}). {help}") from None
    if len(tokenizer) <= len(SPECIAL_TOKEN_ATTRS):
        # transformers 5 returns a tokenizer of only its special tokens for a hub name it has no files for
        raise TokenizerError(f"tokenizer {str(name_or_path)!r} is neither a folder nor in the local Hugging Face "
                             f"cache (transformers found no vocabulary for it: {len(tokenizer)} tokens). {help}")
    return tokenizer


def model_tokenizer(cfg) -> Union[Path, str]:
    """The tokenizer a model folder uses, for ``load_tokenizer``: config.json's ``tokenizer`` (relative to the model
    folder), else the one its pretraining data was built with (meta.json's: a folder relative to the data folder,
    a path, or a hub name). A ConfigError when neither says."""
    from .config import ConfigError
    from .shards import ShardError, read_meta

    if cfg.tokenizer is not None:
        return cfg.path(cfg.tokenizer)
    try:
        meta = read_meta(cfg.data_dir)
        name = meta["tokenizer"]
    except (ShardError, KeyError) as e:
        raise ConfigError(f"{cfg.config_file}: no \"tokenizer\" key, and the data folder's meta.json cannot tell "
                          f"which tokenizer the model uses ({e})") from None
    # The folder as the build saw it, from the data folder (builds since 2026-11-29), then as recorded.
    candidates = [cfg.data_dir / meta["tokenizer_relative"]] if meta.get("tokenizer_relative") else []
    candidates += [cfg.data_dir / name, Path(name).expanduser()]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    if Path(name).is_absolute():  # a folder on the machine that built the data, not here (a container, a copy)
        tried = ", ".join(dict.fromkeys(str(c) for c in candidates))
        raise ConfigError(f"{cfg.config_file}: no \"tokenizer\" key, and the tokenizer folder the data was built "
                          f"with ({cfg.data_dir / 'meta.json'}) is not here (tried {tried}): set \"tokenizer\" to "
                          f"its folder, relative to the model folder (in a container: a folder it mounts)")
    return name


def _tokenizer_setting(cfg) -> str:
    """Where a model folder's tokenizer is named, for messages."""
    return (f"{cfg.config_file}: tokenizer" if cfg.tokenizer is not None
            else f"the tokenizer named in {cfg.data_dir / 'meta.json'}")


def load_model_tokenizer(cfg):
    """The tokenizer a model folder uses (``model_tokenizer``), loaded; an error names the setting that named it."""
    name = model_tokenizer(cfg)
    try:
        return load_tokenizer(name)
    except TokenizerError as e:
        # A hub name from meta.json: the cache of the machine that built the data, not this one's (a container's)
        hint = (f" Or set \"tokenizer\" in {cfg.config_file} to a folder holding its files (relative to the model "
                f"folder; in a container, a folder it mounts)." if cfg.tokenizer is None and isinstance(name, str)
                else "")
        raise TokenizerError(f"{_tokenizer_setting(cfg)}: {e}{hint}") from None


def tokenizer_files_digest(folder: Path) -> Optional[str]:
    """A hash of what identifies a tokenizer folder's ids (the files of TOKENIZER_FILES that are present), as
    build-shards records it in meta.json (``tokenizer_files_sha256``); None for a folder without any."""
    digest, found = hashlib.sha256(), False
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
            found = True
    return digest.hexdigest() if found else None


def check_tokenizer_is_the_datas(cfg) -> None:
    """The tokenizer a model folder uses must have the files its pretraining data was tokenized with, where the
    data's meta.json records them (``tokenizer_files_sha256``): a tokenizer retrained into the same folder since
    (``train-tokenizer --overwrite``) keeps its size and path but gives the ids other words. A ConfigError naming
    the setting; nothing to compare (no data folder here, a hub name, an older meta.json) passes."""
    from .config import ConfigError
    from .shards import ShardError, read_meta

    try:
        path = model_tokenizer(cfg)
        recorded = read_meta(cfg.data_dir).get("tokenizer_files_sha256")
    except (ConfigError, ShardError):
        return
    if not recorded or not isinstance(path, Path) or not path.is_dir():
        return
    if tokenizer_files_digest(path) != recorded:
        raise ConfigError(f"{_tokenizer_setting(cfg)}: the files in {path} are not those the pretraining data in "
                          f"{cfg.data_dir} was tokenized with (its meta.json's tokenizer_files_sha256; retrained or "
                          f"overwritten since?): the model's token ids would mean other words. Use the tokenizer "
                          f"the data was built with")


def check_tokenizer_fits(cfg, tokenizer, log=say) -> None:
    """The tokenizer a model folder uses (``model_tokenizer``) must be the one it was pretrained with: more tokens
    than ``model.vocab_size`` is a ConfigError (ids past the embedding table); a size other than the pretraining
    data's vocabulary (when its meta.json is there to say) is warned about — the ids would mean other words."""
    from .config import ConfigError
    from .shards import ShardError, read_meta

    where = _tokenizer_setting(cfg)
    size = len(tokenizer)
    if size > cfg.model.vocab_size:
        raise ConfigError(f"{where}: {size} tokens, more than model.vocab_size ({cfg.model.vocab_size}): not the "
                          f"tokenizer this model was pretrained with")
    try:
        data_size = read_meta(cfg.data_dir)["vocab_size"]
    except (ShardError, KeyError):
        return  # no pretraining data here (fine-tuning elsewhere): nothing to compare with
    if size != data_size:
        log(f"warning: {where}: {size} tokens, but the pretraining data in {cfg.data_dir} has a {data_size}-token "
            f"vocabulary: is this the tokenizer the model was pretrained with?")
    check_tokenizer_is_the_datas(cfg)


def special_token_ids(tokenizer) -> Dict[str, int]:
    ids = {name: getattr(tokenizer, attr) for name, attr in SPECIAL_TOKEN_ATTRS.items()}
    missing = [n for n, v in ids.items() if v is None]
    if missing:
        raise TokenizerError(f"tokenizer has no {', '.join(missing)} token (MLM pretraining needs all of "
                             f"{', '.join(SPECIAL_TOKEN_ATTRS)})")
    return ids
