"""Tokenizer loading: one function for pretrained folders (RoBERTa's vocab.json + merges.txt, or a
``tokenizer.json``) and for the byte-level BPE that ``nystromformer train-tokenizer`` writes."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Union

SPECIAL_TOKEN_ATTRS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "pad_token_id",
                       "mask": "mask_token_id", "unk": "unk_token_id"}


class TokenizerError(ValueError):
    pass


def load_tokenizer(name_or_path: Union[str, Path]):
    """A transformers fast tokenizer from a folder (preferred: no network) or a cached hub name."""
    from transformers import PreTrainedTokenizerFast, RobertaTokenizerFast

    path = Path(name_or_path)
    if path.is_dir():
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return RobertaTokenizerFast.from_pretrained(str(path))
        if (path / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(path))
        raise TokenizerError(f"{path}: no tokenizer files (expected vocab.json + merges.txt, or tokenizer.json)")
    try:
        return RobertaTokenizerFast.from_pretrained(str(name_or_path), local_files_only=True)
    except Exception as e:
        raise TokenizerError(
            f"tokenizer {str(name_or_path)!r} is neither a folder nor in the local Hugging Face cache ({e}). "
            f"Offline machines: put the tokenizer files (vocab.json, merges.txt) in a folder and pass its path, "
            f"or train one with `nystromformer train-tokenizer`.") from None


def special_token_ids(tokenizer) -> Dict[str, int]:
    ids = {name: getattr(tokenizer, attr) for name, attr in SPECIAL_TOKEN_ATTRS.items()}
    missing = [n for n, v in ids.items() if v is None]
    if missing:
        raise TokenizerError(f"tokenizer has no {', '.join(missing)} token (MLM pretraining needs all of "
                             f"{', '.join(SPECIAL_TOKEN_ATTRS)})")
    return ids
