"""GLUE readers, encoding and submission format: real files from ../shared/data/glue and our own fixtures
in the official layout (tests/fixtures/glue) for the tasks not shipped there."""
import json
from pathlib import Path

import pytest
import torch

from nystromformer.glue.encoding import EncodedDataset, PadCollator
from nystromformer.glue.submission import format_predictions, read_submission, write_submission
from nystromformer.glue.tasks import TASKS, Example, GlueDataError, get_task, read_ax, read_split, read_tsv, Columns

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "glue"


@pytest.fixture
def real_glue(shared_dir) -> Path:
    glue = shared_dir / "data" / "glue"
    if not glue.is_dir():
        pytest.skip(f"needs the real GLUE files at {glue}")
    return glue


@pytest.fixture
def roberta(shared_dir):
    from nystromformer.tokenizer import load_tokenizer
    return load_tokenizer(shared_dir / "tokenizers" / "roberta-base")


def test_task_names_are_forgiving_about_case_dashes_and_underscores():
    assert get_task("sst2").name == "SST-2"
    assert get_task("STS-B").name == get_task("stsb").name == "STS-B"
    assert get_task("mnli").num_labels == 3
    assert get_task("sts-b").is_regression
    assert get_task("sts_b").name == "STS-B" and get_task("sst_2").name == "SST-2"
    with pytest.raises(GlueDataError, match="known tasks: CoLA"):
        get_task("squad")


# (task, split, number of examples, first example's text_a start, first label) of the official files.
REAL_FILES = [
    ("CoLA", "train", 8551, "Our friends won't buy this analysis", 1),
    ("CoLA", "dev", 1043, "The sailors rode the breeze clear of the rocks.", 1),
    ("SST-2", "train", 67349, "hide new secretions from the parental units", 0),
    ("SST-2", "dev", 872, "it 's a charming and often affecting journey .", 1),
    ("RTE", "train", 2490, "No Weapons of Mass Destruction Found in Iraq Yet.", 1),   # not_entailment
    ("RTE", "dev", 277, "Dana Reeve, the widow of the actor Christopher Reeve", 1),
    ("WNLI", "train", 635, "John couldn't see the stage with Billy in front of him", 1),
    ("WNLI", "dev", 71, "The drain is clogged with hair. It has to be cleaned.", 0),
    ("STS-B", "train", 5749, "A plane is taking off.", 5.0),
    ("STS-B", "dev", 1500, "A man with a hard hat is dancing.", 5.0),
]


@pytest.mark.parametrize("task_name,split,count,first_text,first_label", REAL_FILES)
def test_real_files_read_completely_with_known_first_rows(real_glue, task_name, split, count, first_text, first_label):
    result = read_split(real_glue, TASKS[task_name], split)
    assert result.malformed == []
    assert len(result.examples) == count
    first = result.examples[0]
    assert first.text_a.startswith(first_text)
    assert first.label == first_label


def test_real_pairs_have_both_sentences(real_glue):
    first = read_split(real_glue, TASKS["RTE"], "dev").examples[0]
    assert first.text_b == "Christopher Reeve had an accident."
    sts = read_split(real_glue, TASKS["STS-B"], "train").examples[1]
    assert (sts.text_a, sts.text_b, sts.label) == ("A man is playing a large flute.", "A man is playing a flute.", 3.8)


def test_real_test_splits_keep_their_index_and_have_no_labels(real_glue):
    result = read_split(real_glue, TASKS["SST-2"], "SST-2.tsv")
    assert len(result.examples) == 1821
    assert result.examples[1].index == "1"
    assert result.examples[0].text_a == "uneasy mishmash of styles and genres ."
    assert all(e.label is None for e in result.examples)
    assert len(read_split(real_glue, TASKS["CoLA"], "CoLA.tsv").examples) == 1063


def test_fixture_tasks_read_with_labels_in_class_order():
    mrpc = read_split(FIXTURES, TASKS["MRPC"], "train")
    assert [e.label for e in mrpc.examples] == [1, 0, 1]
    # Quotes inside the text are kept as they are (QUOTE_NONE), not parsed as CSV quoting.
    assert mrpc.examples[0].text_a.startswith('Amrozi accused his brother , whom he called " the witness "')
    qnli = read_split(FIXTURES, TASKS["QNLI"], "dev")
    assert [e.label for e in qnli.examples] == [0, 1]          # entailment, not_entailment
    mnli = read_split(FIXTURES, TASKS["MNLI"], "matched")
    assert [e.label for e in mnli.examples] == [2, 0, 2]       # gold_label: neutral, contradiction, neutral
    assert len(read_split(FIXTURES, TASKS["MNLI"], "mismatched").examples) == 2
    assert [e.index for e in read_split(FIXTURES, TASKS["MNLI"], "MNLI-mm.tsv").examples] == ["0"]
    assert len(read_ax(FIXTURES).examples) == 3


def test_malformed_qqp_row_is_counted_and_named_not_dropped_silently():
    result = read_split(FIXTURES, TASKS["QQP"], "train")
    assert [e.index for e in result.examples] == ["133273", "402555", "360472"]
    assert result.malformed == ["train.tsv:4: 4 fields, expected 6"]
    assert "skipped 1 malformed row(s): train.tsv:4" in result.report()


PAIR = Columns(text_a="sentence1", text_b="sentence2", label="label", index="index")


def test_unknown_labels_empty_texts_shifted_columns_and_bad_scores_are_reported(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment \n1\ta\tb\tmaybe\n"
                    "2\t\tb\tentailment\n3\ta\t \tentailment\n4\ta\tb\tc\tentailment\n")
    result = read_tsv(path, PAIR, ["entailment", "not_entailment"])
    assert [(e.index, e.label) for e in result.examples] == [("0", 0)]  # labels are read without their spaces
    assert result.malformed == ["dev.tsv:3: unknown label 'maybe' (expected one of entailment, not_entailment)",
                                "dev.tsv:4: empty text", "dev.tsv:5: empty text",
                                "dev.tsv:6: 5 fields, expected 4"]  # an extra tab would shift the columns
    path.write_text("index\tsentence1\tsentence2\tscore\n0\ta\tb\tfive\n")
    result = read_tsv(path, Columns(text_a="sentence1", text_b="sentence2", label="score", index="index"), None)
    assert result.malformed == ["dev.tsv:2: score 'five' is not a number"]


def test_a_file_starting_with_a_byte_order_mark_reads_its_header(tmp_path):
    (tmp_path / "RTE").mkdir()
    (tmp_path / "RTE" / "train.tsv").write_bytes(
        "\ufeffindex\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n".encode("utf-8"))
    assert [e.index for e in read_split(tmp_path, get_task("RTE"), "train").examples] == ["0"]


def test_a_file_without_an_index_column_indexes_rows_by_their_position_malformed_rows_included(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text("sentence\tlabel\ngood\t1\nbad\t7\n\nfine\t0\n")  # a blank line is not a row
    result = read_tsv(path, Columns(text_a="sentence", label="label"), ["0", "1"])
    assert [(e.index, e.text_a) for e in result.examples] == [("0", "good"), ("2", "fine")]


def test_missing_file_and_wrong_header_are_clear_errors(tmp_path):
    with pytest.raises(GlueDataError, match="missing GLUE file"):
        read_split(tmp_path, TASKS["RTE"], "train")
    (tmp_path / "RTE").mkdir()
    (tmp_path / "RTE" / "train.tsv").write_text("id\tpremise\thypothesis\tlabel\n")
    with pytest.raises(GlueDataError, match="no column 'sentence1'"):
        read_split(tmp_path, TASKS["RTE"], "train")


def test_pairs_are_encoded_as_the_tokenizer_pairs_them_and_padded_per_batch(roberta):
    examples = read_split(FIXTURES, TASKS["MRPC"], "train").examples
    data = EncodedDataset(examples, roberta, max_seq_len=16)
    expected = roberta(examples[1].text_a, examples[1].text_b, truncation="longest_first", max_length=16)["input_ids"]
    assert data[1]["input_ids"] == expected and len(expected) == 16
    assert data[1]["input_ids"][0] == roberta.bos_token_id

    short = EncodedDataset(read_split(FIXTURES, TASKS["QQP"], "dev").examples, roberta, max_seq_len=64)
    batch = PadCollator(roberta.pad_token_id, regression=False)([short[0], short[1]])
    lengths = [len(short[0]["input_ids"]), len(short[1]["input_ids"])]
    assert batch["input_ids"].shape == (2, max(lengths))        # the batch's longest, not max_seq_len
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    shorter = lengths.index(min(lengths))
    assert (batch["input_ids"][shorter, min(lengths):] == roberta.pad_token_id).all()
    assert batch["labels"].tolist() == [0, 0] and batch["labels"].dtype == torch.long

    scores = PadCollator(roberta.pad_token_id, regression=True)([{"input_ids": [0, 2], "label": 3.8}])
    assert scores["labels"].dtype == torch.float32


@pytest.mark.parametrize("attn_type, padded_to", [("softmax", "longest"), ("linformer", "longest"),
                                                  ("nystrom", "max_seq_len"), ("reformer", "max_seq_len"),
                                                  ("bigbird", "max_seq_len")])
def test_attention_that_depends_on_the_amount_of_padding_gets_every_batch_padded_to_max_seq_len(roberta, attn_type,
                                                                                              padded_to):
    # Else a Nyström model's prediction for a sentence would depend on the longest sentence of its batch (its
    # landmarks move), and a batch of at most num_landmarks tokens would be exact softmax, not Nyström.
    from nystromformer.config import ModelConfig
    from nystromformer.glue.finetune import collator
    short = EncodedDataset(read_split(FIXTURES, TASKS["QQP"], "dev").examples, roberta, max_seq_len=64)
    collate = collator(ModelConfig(attn_type=attn_type), roberta, TASKS["QQP"], max_seq_len=64)
    batch = collate([short[0], short[1]])
    lengths = [len(short[0]["input_ids"]), len(short[1]["input_ids"])]
    assert batch["input_ids"].shape == (2, max(lengths) if padded_to == "longest" else 64)
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths


def test_submission_format(tmp_path):
    assert format_predictions(["entailment", "not_entailment"], torch.tensor([[0.1, 2.0], [3.0, -1.0]]).numpy()) == \
        ["not_entailment", "entailment"]
    assert format_predictions(["0", "1"], torch.tensor([[0.0, 1.0]]).numpy()) == ["1"]
    # STS-B scores are clipped to the [0, 5] range of the labels.
    assert format_predictions(None, torch.tensor([-0.4, 2.5, 7.0]).numpy()) == ["0.000", "2.500", "5.000"]
    write_submission(tmp_path / "RTE.tsv", ["0", "1"], ["entailment", "not_entailment"])
    assert (tmp_path / "RTE.tsv").read_text() == "index\tprediction\n0\tentailment\n1\tnot_entailment\n"
    assert read_submission(tmp_path / "RTE.tsv") == [["0", "entailment"], ["1", "not_entailment"]]


@pytest.mark.parametrize("score", ["nan", "inf", "-0.5", "700"])
def test_an_sts_b_score_outside_0_to_5_is_a_malformed_row_named_by_line(tmp_path, score):
    folder = tmp_path / "STS-B"
    folder.mkdir()
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    rows = [f"{i}\tmain-captions\tMSRvid\t2012test\t{i}\tnone\tnone\tA man plays.\tA man is playing.\t{s}\n"
            for i, s in enumerate(["3.2", score, "5.000"])]
    (folder / "train.tsv").write_text(header + "".join(rows))
    result = read_split(tmp_path, get_task("STS-B"), "train")
    assert [e.label for e in result.examples] == [3.2, 5.0]
    assert result.malformed == [f"train.tsv:3: score {score!r} is outside 0 to 5"]


def test_a_test_file_index_given_twice_is_a_malformed_row_naming_both_lines(tmp_path):
    path = tmp_path / "test.tsv"
    path.write_text("index\tsentence\n0\tA fine film.\n1\tDull.\n0\tAgain?\n")
    result = read_tsv(path, Columns(text_a="sentence", index="index"), ["0", "1"], with_labels=False)
    assert [e.index for e in result.examples] == ["0", "1"]
    assert result.malformed == ["test.tsv:4: index '0' again (first at line 2)"]


def test_an_index_repeated_in_a_labelled_file_is_kept_only_test_files_need_unique_indices(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n0\tc\td\tnot_entailment\n")
    result = read_tsv(path, PAIR, ["entailment", "not_entailment"])
    assert [(e.index, e.label) for e in result.examples] == [("0", 0), ("0", 1)] and result.malformed == []


def bert_style_tokenizer(folder):
    """A tiny BERT-style WordPiece tokenizer in a folder load_tokenizer reads (tokenizer.json): [CLS] a [SEP] b [SEP],
    segment B typed 1. [PAD] is not id 0 here, so token types padded with the pad id would show."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from nystromformer.tokenizer import load_tokenizer

    vocab = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
         "mask_token": "[MASK]"}))
    return load_tokenizer(folder)


def test_a_bert_style_tokenizer_types_the_first_sentence_0_and_the_second_1_after_truncation_and_padding(tmp_path):
    bert = bert_style_tokenizer(tmp_path / "bert")
    assert bert.pad_token_id == 3
    examples = [Example("0", "The cat sat on the mat", "a dog", 1),   # 6 + 2 words: the longer side is cut to 3
                Example("1", "cat", "dog ran", 0)]
    data = EncodedDataset(examples, bert, max_seq_len=8, with_token_types=True)
    cls, sep, pad = 1, 2, 3
    assert data[0]["input_ids"] == [cls, 5, 6, 7, sep, 10, 11, sep]          # [CLS] the cat sat [SEP] a dog [SEP]
    assert data[0]["token_type_ids"] == [0, 0, 0, 0, 0, 1, 1, 1]
    assert data[1]["input_ids"] == [cls, 6, sep, 11, 12, sep]
    assert data[1]["token_type_ids"] == [0, 0, 0, 1, 1, 1]

    batch = PadCollator(bert.pad_token_id, regression=False)([data[1], data[0]])
    assert batch["input_ids"].tolist() == [[cls, 6, sep, 11, 12, sep, pad, pad], data[0]["input_ids"]]
    assert batch["attention_mask"].tolist() == [[1] * 6 + [0] * 2, [1] * 8]
    # The types stay aligned with their tokens; padding is type 0 (a pad id could be past the type embeddings).
    assert batch["token_type_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 1, 1]]
    assert batch["token_type_ids"].dtype == torch.long

    # Without token types (a model with one sentence type) no types are made, whatever the tokenizer.
    plain = EncodedDataset(examples, bert, max_seq_len=8)
    assert "token_type_ids" not in plain[0]
    assert "token_type_ids" not in PadCollator(bert.pad_token_id, regression=False)([plain[0], plain[1]])


def test_roberta_gives_all_zero_token_types_when_the_model_takes_them(roberta):
    examples = [Example("0", "A man plays.", "A man is playing a guitar.", 1), Example("1", "Hi.", "Yo.", 0)]
    data = EncodedDataset(examples, roberta, max_seq_len=64, with_token_types=True)
    for item in (data[0], data[1]):
        assert item["token_type_ids"] == [0] * len(item["input_ids"])
    batch = PadCollator(roberta.pad_token_id, regression=False)([data[0], data[1]])
    assert batch["token_type_ids"].shape == batch["input_ids"].shape and not batch["token_type_ids"].any()


def test_a_test_split_keeps_rows_with_an_empty_text_and_refuses_an_index_given_twice(tmp_path):
    # The server wants one prediction per test index: a test row with an empty question is predicted, not dropped
    # as a labelled row would be; an index given twice is a malformed row (read through read_split, as glue reads it).
    (tmp_path / "QQP").mkdir()
    (tmp_path / "QQP" / "test.tsv").write_text("id\tquestion1\tquestion2\n0\tWhy?\t\n1\tHow?\tWhat?\n1\tAgain?\tYes.\n")
    result = read_split(tmp_path, get_task("QQP"), "QQP.tsv")
    assert [(e.index, e.text_b) for e in result.examples] == [("0", ""), ("1", "What?")]
    assert result.malformed == ["test.tsv:4: index '1' again (first at line 3)"]


def test_rows_of_a_header_less_file_are_named_by_their_line_in_the_file_blank_lines_included(tmp_path):
    (tmp_path / "CoLA").mkdir()
    (tmp_path / "CoLA" / "dev.tsv").write_text("gj04\t1\t\tGood.\n\n\ngj04\t7\t\tBad label.\ngj04\t1\tShifted.\n"
                                               "gj04\t1\t\t\ngj04\t0\t*\tFine.\ngj04\t1\n")
    result = read_split(tmp_path, get_task("CoLA"), "dev")
    assert [(e.index, e.label) for e in result.examples] == [("0", 1), ("4", 0)]  # CoLA rows: their position
    assert result.malformed == ["dev.tsv:4: unknown label '7' (expected one of 0, 1)", "dev.tsv:5: 3 fields, expected 4",
                                "dev.tsv:6: empty text", "dev.tsv:8: 2 fields, expected 4"]
    assert result.report().endswith("skipped 4 malformed row(s): dev.tsv:4: unknown label '7' (expected one of 0, 1); "
                                    "dev.tsv:5: 3 fields, expected 4; dev.tsv:6: empty text (and 1 more)")
