"""The word-cached byte-level BPE gives exactly the tokenizer's own ids, faster."""
import random

import pytest

from nystromformer.data import tokenize as tok_mod
from nystromformer.data.tokenize import DocumentEncoder
from nystromformer.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def roberta():
    from conftest import SHARED
    if not SHARED.is_dir():
        pytest.skip(f"needs the RoBERTa tokenizer in {SHARED} (absent here)")
    return load_tokenizer(SHARED / "tokenizers" / "roberta-base")


def library_ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def random_text(rng: random.Random, length: int) -> str:
    ranges = [(0x20, 0x7E), (0xA0, 0x17F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0x3040, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0x1F300, 0x1F6FF), (0x300, 0x36F)]
    pieces = []
    for _ in range(length):
        r = rng.random()
        if r < 0.15:
            pieces.append(rng.choice([" ", "  ", "\t", "\n", "\n\n", " \n ", "\u200d", "\u00a0", "'s", "'ll", "123"]))
        else:
            lo, hi = rng.choice(ranges)
            pieces.append(chr(rng.randint(lo, hi)))
    return "".join(pieces)


def test_word_cache_applies_to_roberta_and_matches_on_mixed_unicode(roberta):
    encoder = DocumentEncoder(roberta)
    assert encoder.word_cache is not None
    rng = random.Random(0)
    docs = [random_text(rng, rng.randint(1, 400)) for _ in range(300)]
    for doc, ids in zip(docs, encoder.encode(docs)):
        assert ids.tolist() == library_ids(roberta, doc), repr(doc)


def test_word_cache_matches_on_real_wikipedia_text(roberta, shared_dir, tmp_path):
    import subprocess
    import sys
    ex = tmp_path / "extracted"
    subprocess.run([sys.executable, "-m", "nystromformer.cli", "extract-wiki", "--dump",
                    str(shared_dir / "data" / "wiki" / "enwiki-sample-pages-articles.xml.bz2"), "--output", str(ex)],
                   check=True, capture_output=True)
    text = "".join(p.read_text() for p in sorted(ex.rglob("wiki_*")))[:1_500_000]
    docs = [d for d in text.split("</doc>") if d.strip()]
    encoder = DocumentEncoder(roberta)
    assert [ids.tolist() for ids in encoder.encode(docs)] == [library_ids(roberta, d) for d in docs]


def test_text_that_spells_a_special_token_is_encoded_as_text_not_as_the_special_id(roberta):
    # A literal </s> would be a document boundary, <pad> masked out of attention, <mask> a position to fill.
    doc = "The <mask> sat on </s> the <s>mat<pad> and <unk>."
    (ids,) = DocumentEncoder(roberta).encode([doc])
    assert ids.tolist() == library_ids(roberta, doc)
    assert not set(ids.tolist()) & set(roberta.all_special_ids)
    assert roberta.decode(ids.tolist()) == doc
    assert roberta("<mask>", add_special_tokens=False)["input_ids"] == [roberta.mask_token_id]  # caller's unchanged


def test_a_full_cache_restarts_without_changing_ids(roberta, monkeypatch):
    monkeypatch.setattr(tok_mod, "WORD_CACHE_CAPACITY", 8)
    encoder = DocumentEncoder(roberta)
    rng = random.Random(1)
    docs = [random_text(rng, 200) for _ in range(20)]
    assert [i.tolist() for i in encoder.encode(docs)] == [library_ids(roberta, d) for d in docs]
    assert len(encoder.word_cache.cache) <= 8


def test_other_tokenizers_use_the_library(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]")
    encoder = DocumentEncoder(tokenizer)
    assert encoder.word_cache is None
    assert encoder.encode(["hello world there"])[0].tolist() == [1, 2, 0]


def test_letters_newer_than_the_tokenizers_unicode_tables_fall_back_to_the_library(roberta):
    # U+0558 is a letter in recent Unicode (the `regex` package) but unassigned in older tables.
    docs = ["a\u0558's b", "x \U0001E030's y", "plain text's fine"]
    encoder = DocumentEncoder(roberta)
    assert [i.tolist() for i in encoder.encode(docs)] == [library_ids(roberta, d) for d in docs]


def test_added_tokens_of_any_spelling_go_through_the_library(roberta):
    roberta = load_tokenizer(roberta.name_or_path)
    roberta.add_tokens(["[NEWTOK]"])
    doc = "a [NEWTOK] b"
    (ids,) = DocumentEncoder(roberta).encode([doc])
    assert ids.tolist() == library_ids(roberta, doc)


def test_a_word_cache_that_disagrees_with_the_tokenizer_on_the_probe_is_not_used(roberta, monkeypatch, caplog):
    # The start-up probe is the safety net for tokenizers the word cache was not checked on: simulate a defect.
    real = tok_mod.WordCachedBPE.encode_word
    monkeypatch.setattr(tok_mod.WordCachedBPE, "encode_word", lambda self, word: tuple(reversed(real(self, word))))
    with caplog.at_level("WARNING"):
        encoder = DocumentEncoder(roberta, allow_word_cache=True)
    assert encoder.word_cache is None and "disagrees with the tokenizer on a probe text" in caplog.text
    text = "Tokenizers must agree id for id."
    assert encoder.encode([text])[0].tolist() == library_ids(roberta, text)


@pytest.fixture
def roberta_saving_truncation_and_padding(roberta, tmp_path):
    """RoBERTa from a folder whose tokenizer.json enables truncation to 8 ids and padding to the batch's longest,
    as a tokenizer saved after `tokenizer(..., truncation=True, padding=True)` can."""
    return saving_truncation_and_padding(roberta, tmp_path)


@pytest.fixture
def trained_saving_truncation_and_padding(tmp_path):
    """The same with a byte-level BPE `train-tokenizer` made here (no ../shared needed: the test runs in CI)."""
    from nystromformer.data.tokenize import train_tokenizer
    partitions = tmp_path / "partitions"
    partitions.mkdir()
    words = "one two three four five six seven eight nine ten eleven twelve short a document that spells and goes"
    (partitions / "part-00000.txt").write_text("\n\n".join(f"{words} {i} {words[::-1]}" for i in range(50)) + "\n")
    return saving_truncation_and_padding(load_tokenizer(train_tokenizer([partitions], tmp_path / "trained", 400)),
                                         tmp_path)


def saving_truncation_and_padding(tokenizer, tmp_path):
    import json
    import shutil
    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer.name_or_path, folder)
    config = json.loads(tokenizer.backend_tokenizer.to_str())
    config["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    config["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                         "pad_id": tokenizer.pad_token_id, "pad_type_id": 0, "pad_token": tokenizer.pad_token}
    (folder / "tokenizer.json").write_text(json.dumps(config))
    saved = load_tokenizer(folder)
    assert saved.backend_tokenizer.truncation and saved.backend_tokenizer.padding  # as saved
    return saved


@pytest.mark.parametrize("source", ["trained", "roberta"])
@pytest.mark.parametrize("word_cache", [True, False], ids=["word-cache", "library"])
def test_truncation_and_padding_saved_in_a_tokenizer_json_neither_cut_nor_pad_documents(request, source, word_cache):
    # Whole documents are packed into one stream: a cut document loses text, a <pad> id inside the stream is
    # masked out of attention. tokenizer(text) disables both per call; the encoder must too.
    tokenizer = request.getfixturevalue(f"{source}_saving_truncation_and_padding")
    docs = ["one two three four five six seven eight nine ten eleven twelve", "short",
            "a document that spells <mask> and </s> goes through the library even with the word cache on"]
    encoder = DocumentEncoder(tokenizer, allow_word_cache=word_cache)
    assert tokenizer.backend_tokenizer.truncation  # the caller's tokenizer is unchanged (tokenizer() resets it)
    assert (encoder.word_cache is not None) == word_cache  # (the probe text agrees: not cut to 8 ids)
    expected = [library_ids(tokenizer, d) for d in docs]
    assert len(expected[0]) > 8 and len(expected[1]) < 8
    assert [ids.tolist() for ids in encoder.encode(docs)] == expected
