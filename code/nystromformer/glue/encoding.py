"""Turn GLUE examples into model inputs: tokenize once, pad per batch.

Pairs are joined the way the tokenizer joins them (RoBERTa: ``<s> a </s></s> b </s>``), truncating the
longer side first. Padding is dynamic (to the longest sequence of each batch), which is most of the
speed-up of fine-tuning on short GLUE sentences.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch.utils.data import Dataset

from .tasks import Example


class EncodedDataset(Dataset):
    def __init__(self, examples: List[Example], tokenizer, max_seq_len: int, with_token_types: bool = False):
        texts_a = [e.text_a for e in examples]
        texts_b = [e.text_b for e in examples] if examples and examples[0].text_b is not None else None
        enc = tokenizer(texts_a, texts_b, truncation="longest_first" if texts_b else True,
                        max_length=max_seq_len, return_token_type_ids=with_token_types)
        self.input_ids: List[List[int]] = enc["input_ids"]
        self.token_type_ids: Optional[List[List[int]]] = enc.get("token_type_ids") if with_token_types else None
        self.labels = [e.label for e in examples]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> Dict:
        item = {"input_ids": self.input_ids[i], "label": self.labels[i]}
        if self.token_type_ids is not None:
            item["token_type_ids"] = self.token_type_ids[i]
        return item


class PadCollator:
    """Pad a list of items to the batch's longest sequence, or to ``pad_to`` tokens when given (for attention whose
    outputs depend on the amount of padding); the attention mask marks real tokens."""

    def __init__(self, pad_token_id: int, regression: bool, pad_to: Optional[int] = None):
        self.pad_token_id = pad_token_id
        self.regression = regression
        self.pad_to = pad_to

    def __call__(self, items: List[Dict]) -> Dict[str, torch.Tensor]:
        longest = self.pad_to or max(len(item["input_ids"]) for item in items)
        input_ids = torch.full((len(items), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(items), longest), dtype=torch.long)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            input_ids[row, :n] = torch.tensor(item["input_ids"])
            attention_mask[row, :n] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "token_type_ids" in items[0]:
            token_type_ids = torch.zeros((len(items), longest), dtype=torch.long)
            for row, item in enumerate(items):
                token_type_ids[row, :len(item["token_type_ids"])] = torch.tensor(item["token_type_ids"])
            batch["token_type_ids"] = token_type_ids
        if items[0]["label"] is not None:
            dtype = torch.float32 if self.regression else torch.long
            batch["labels"] = torch.tensor([item["label"] for item in items], dtype=dtype)
        return batch
