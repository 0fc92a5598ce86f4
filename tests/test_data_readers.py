"""Readers and partitions: each dataset's raw format -> documents separated by blank lines, bad input counted."""
import argparse
import json
from pathlib import Path

import pytest

from nystromformer.data import commands
from nystromformer.data.partitions import read_partition
from nystromformer.data.readers import SkipLog, bookcorpus_documents, expand_inputs

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "data"


def run_command(argv):
    parser = argparse.ArgumentParser()
    commands.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


def preprocess(tmp_path, dataset, *extra):
    out = tmp_path / dataset
    assert run_command(["preprocess", dataset, "--input", FIXTURES / dataset, "--output", out, *extra]) == 0
    stats = json.loads((out / "stats.json").read_text())
    documents = [d for p in sorted(out.glob("part-*.txt")) for d in read_partition(p)]
    return stats, documents


def test_wiki_keeps_long_articles_without_title_and_counts_every_malformed_doc(tmp_path):
    stats, documents = preprocess(tmp_path, "wiki")
    assert stats["documents_kept"] == 3 and len(documents) == 3  # articles 1, 2 and 6
    assert stats["documents_too_short"] == 1  # "Stub" has fewer than 128 words
    assert stats["skipped"]["counts"] == {"empty_file": 1, "malformed_doc_tag": 2, "undecodable_bytes": 1}
    assert not any(d.startswith(("Northern Cape", "Harbour", "Fine")) for d in documents)  # title line dropped
    assert all("<doc" not in d and "</doc>" not in d for d in documents)
    examples = stats["skipped"]["first_examples"]
    assert any(e.startswith(str(FIXTURES / "wiki/AA/wiki_01") + ":1:") for e in examples["malformed_doc_tag"])
    assert examples["undecodable_bytes"][0].startswith(str(FIXTURES / "wiki/AA/wiki_01") + ":")


def test_wiki_malformed_docs_are_named_in_the_log_with_file_and_line(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="nystromformer.data"):
        preprocess(tmp_path, "wiki")
    assert f"{FIXTURES / 'wiki/AA/wiki_01'}:1" in caplog.text  # the broken opening tag
    assert "wiki_02" in caplog.text and "empty_file" in caplog.text


def test_partitions_hold_documents_separated_by_one_blank_line_and_split_by_word_count(tmp_path):
    stats, documents = preprocess(tmp_path, "wiki", "--words-per-partition", "100")
    assert stats["partitions"] == ["part-00000.txt", "part-00001.txt", "part-00002.txt"]  # one article each
    text = (tmp_path / "wiki" / "part-00000.txt").read_text()
    assert text.endswith("\n\n") and "\n\n\n" not in text and text.count("\n\n") == 1
    assert stats["words"] == sum(len(d.split()) for d in documents)


def test_rerunning_preprocess_with_bigger_partitions_removes_stale_partition_files(tmp_path):
    preprocess(tmp_path, "wiki", "--words-per-partition", "100")
    stats, _ = preprocess(tmp_path, "wiki")
    assert sorted(p.name for p in (tmp_path / "wiki").glob("part-*.txt")) == ["part-00000.txt"]


def test_bookcorpus_documents_end_at_blank_lines_or_after_the_sentence_limit(tmp_path):
    stats, documents = preprocess(tmp_path, "bookcorpus")
    assert [len(d.splitlines()) for d in documents] == [12, 13, 9]  # p1: two books; p2: one, bad line dropped
    assert stats["skipped"]["counts"] == {"empty_file": 1, "undecodable_bytes": 1}
    skips = SkipLog()
    files = expand_inputs([FIXTURES / "bookcorpus"], "*.txt")
    sizes = [len(d.splitlines()) for d in bookcorpus_documents(files, skips, sentences_per_document=5)]
    assert sizes == [5, 5, 2, 5, 5, 3, 5, 4]


def test_stories_are_one_document_per_file_and_bad_files_are_skipped(tmp_path):
    stats, documents = preprocess(tmp_path, "stories")
    assert len(documents) == 2
    assert stats["skipped"]["counts"] == {"empty_file": 1, "undecodable_bytes": 1}
    assert "story-0003.txt:1" in stats["skipped"]["first_examples"]["undecodable_bytes"][0]


def test_realnews_keeps_articles_of_1000_words_and_counts_bad_lines(tmp_path):
    stats, documents = preprocess(tmp_path, "realnews")
    assert len(documents) == 2 and all(len(d.split()) >= 1000 for d in documents)
    assert stats["documents_too_short"] == 1
    assert stats["skipped"]["counts"] == {"bad_json": 1, "missing_text": 1, "undecodable_bytes": 1}
    where = {reason: examples[0].split(": ")[0]
             for reason, examples in stats["skipped"]["first_examples"].items()}
    jsonl = FIXTURES / "realnews" / "realnews.jsonl"
    assert where == {"bad_json": f"{jsonl}:3", "missing_text": f"{jsonl}:4", "undecodable_bytes": f"{jsonl}:5"}


def test_min_words_is_configurable(tmp_path):
    stats, documents = preprocess(tmp_path, "realnews", "--min-words", "10")
    assert len(documents) == 3 and stats["documents_too_short"] == 0


def test_missing_input_folder_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        run_command(["preprocess", "stories", "--input", tmp_path / "nowhere", "--output", tmp_path / "out"])


def test_data_commands_are_registered_in_the_cli():
    from nystromformer import cli
    assert "nystromformer.data.commands" in cli.COMMAND_MODULES


def test_a_lone_carriage_return_inside_a_document_is_text_not_a_document_boundary(tmp_path):
    from nystromformer.data.partitions import read_partition
    path = tmp_path / "part-00000.txt"
    path.write_bytes("first line\rsame document\r\rstill the same\n\nsecond document\n\n".encode())
    assert list(read_partition(path)) == ["first line\rsame document\r\rstill the same", "second document"]
