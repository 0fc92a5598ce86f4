"""Readers and partitions: each dataset's raw format -> documents separated by blank lines, bad input counted."""
import argparse
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nystromformer import cli
from nystromformer.data import commands
from nystromformer.data.partitions import PartitionError, partition_files, read_partition, write_partitions
from nystromformer.data.readers import (SkipLog, bookcorpus_documents, expand_inputs, realnews_documents,
                                        stories_documents, wiki_documents)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "data"


def run_command(argv):
    parser = argparse.ArgumentParser()
    commands.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    return cli.run_command(args.func, args)  # as `nystromformer <command>`: a user error is one line, status 2


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


def test_wiki_text_is_unescaped_exactly_as_wikiextractor_escaped_it_and_transclusion_tags_dropped(tmp_path):
    # wikiextractor's default output: the text through html.escape(quote=False), tags it does not know left in
    article = ("AT&T and R&D; 2 < 3 > 1; the entity &lt; written out; &copy without a semicolon " * 20).strip()
    escaped = article.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    folder = tmp_path / "extracted" / "AA"
    folder.mkdir(parents=True)
    (folder / "wiki_00").write_text(f'<doc id="1" url="u" title="T">\nT\n\n&lt;onlyinclude&gt;\n{escaped}\n'
                                    f'&lt;/onlyinclude&gt;&lt;noinclude /&gt;\n</doc>\n')
    documents = list(wiki_documents(expand_inputs([tmp_path / "extracted"], "wiki_*"), SkipLog()))
    assert documents == [article]


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


def test_realnews_lines_python_cannot_parse_or_encode_are_skipped_and_named_not_fatal(tmp_path):
    # Valid JSON that still cannot become UTF-8 text (a lone surrogate escape, half an emoji), and JSON beyond
    # Python's parser (a 5000-digit number, deep nesting): skipped and counted like any bad line.
    good = json.dumps({"text": "a whole article"})
    jsonl = tmp_path / "news.jsonl"
    jsonl.write_text("\n".join([good, '{"text": "emoji cut \\ud83d here"}', '{"n": ' + "9" * 5000 + "}",
                                 "[" * 100_000, good]) + "\n")
    skips = SkipLog()
    assert list(realnews_documents([jsonl], skips)) == ["a whole article"] * 2
    assert skips.counts == {"lone_surrogate": 1, "bad_json": 2}
    assert [e.split(": ")[0] for e in skips.examples["bad_json"]] == [f"{jsonl}:3", f"{jsonl}:4"]
    assert skips.examples["lone_surrogate"][0].startswith(f"{jsonl}:2: ")


def test_a_file_reached_by_two_overlapping_inputs_is_read_once(tmp_path, caplog):
    (tmp_path / "AA").mkdir()
    for name in ("wiki_00", "wiki_01"):
        (tmp_path / "AA" / name).write_text("x")
    files = expand_inputs([tmp_path, tmp_path / "AA" / "wiki_00"], "wiki_*")
    assert files == [tmp_path / "AA" / "wiki_00", tmp_path / "AA" / "wiki_01"]
    assert "wiki_00: already an input" in caplog.text


def test_files_in_hidden_folders_below_an_input_folder_are_not_read_like_hidden_files(tmp_path):
    # .ipynb_checkpoints and .git hold copies of the inputs: read, every document would be in the corpus twice.
    stories = tmp_path / "stories"
    for name in ("a.txt", "sub/b.txt", ".a.txt", ".ipynb_checkpoints/a-checkpoint.txt", "sub/.git/b.txt",
                 ".cache/sub/c.txt"):
        (stories / name).parent.mkdir(parents=True, exist_ok=True)
        (stories / name).write_text("a story")
    assert expand_inputs([stories], "*.txt") == [stories / "a.txt", stories / "sub" / "b.txt"]
    # Only names below the input folder count: a hidden folder given as the input (or above it) is read.
    assert expand_inputs([stories / ".cache"], "*.txt") == [stories / ".cache" / "sub" / "c.txt"]


def test_a_wiki_article_with_several_undecodable_lines_is_counted_once_as_the_article_skipped(tmp_path):
    # The article is the unit skipped: two bad lines in one article are one undecodable_bytes skip, not two.
    wiki = tmp_path / "wiki_00"
    wiki.write_bytes(b'<doc id="1" url="u" title="Two">\nTwo\nbad \xff line\nfine line\nbad \xfe again\n</doc>\n'
                     b'<doc id="2" url="u" title="Kept">\nKept\nkept text\n</doc>\n'
                     b'<doc id="3" url="u" title="One">\nOne\nbad \xff only line\n</doc>\n')
    skips = SkipLog()
    assert list(wiki_documents([wiki], skips)) == ["kept text"]
    assert skips.counts == {"undecodable_bytes": 2}
    assert [e.split(": ")[0] for e in skips.examples["undecodable_bytes"]] == [f"{wiki}:3", f"{wiki}:13"]
    assert all(e.endswith("; whole article skipped") for e in skips.examples["undecodable_bytes"])


def test_a_book_whose_only_line_is_undecodable_is_counted_once_as_such(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"bad \xff bytes only line\n")
    skips = SkipLog()
    assert list(bookcorpus_documents([tmp_path / "b.txt"], skips, document_per_file=True)) == []
    assert skips.counts == {"undecodable_bytes": 1}


@pytest.mark.parametrize("min_words", ["10", "0"])
def test_min_words_is_configurable_and_zero_keeps_every_document(tmp_path, min_words):
    stats, documents = preprocess(tmp_path, "realnews", "--min-words", min_words)
    assert len(documents) == 3 and stats["documents_too_short"] == 0 and stats["min_words"] == int(min_words)


def test_a_document_of_exactly_min_words_is_kept_as_the_paper_says_at_least(tmp_path):
    documents = [" ".join(["w"] * 128), " ".join(["w"] * 127)]
    stats = write_partitions(iter(documents), tmp_path / "p", "wiki", SkipLog(), min_words=128)
    assert stats["documents_kept"] == 1 and stats["documents_too_short"] == 1


def test_a_partition_closes_as_soon_as_it_reaches_words_per_partition(tmp_path):
    documents = [" ".join([f"d{i}"] * 5) for i in range(4)]  # 5 words each, 10 per partition: two and two
    write_partitions(iter(documents), tmp_path / "p", "wiki", SkipLog(), words_per_partition=10)
    assert [list(read_partition(p)) for p in partition_files(tmp_path / "p")] == [documents[:2], documents[2:]]


@pytest.mark.parametrize("text", ["one doc\n\nlast doc\n", "one doc\n\nlast doc"], ids=["newline", "no-newline"])
def test_a_partition_file_from_another_tool_keeps_its_last_document_without_a_trailing_blank_line(tmp_path, text):
    path = tmp_path / "part-00000.txt"
    path.write_text(text)
    assert list(read_partition(path)) == ["one doc", "last doc"]


def test_a_book_file_of_only_whitespace_is_counted_as_empty_not_dropped_silently(tmp_path):
    (tmp_path / "a.txt").write_text("One line.\n")
    (tmp_path / "b.txt").write_text("  \n\n\t\n")
    skips = SkipLog()
    documents = list(bookcorpus_documents([tmp_path / "a.txt", tmp_path / "b.txt"], skips, document_per_file=True))
    assert documents == ["One line."] and skips.counts == {"empty_file": 1}


def file_states(folder):
    return {p.relative_to(folder): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def assert_one_error_line(capsys, *named):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert all(str(n) in err for n in named), err


def test_missing_input_folder_is_an_error_naming_it(tmp_path, capsys):
    code = run_command(["preprocess", "stories", "--input", tmp_path / "nowhere", "--output", tmp_path / "out"])
    assert code == 2
    assert_one_error_line(capsys, tmp_path / "nowhere")
    assert not (tmp_path / "out").exists()


def test_user_errors_of_every_data_command_are_one_error_line_not_a_traceback(tmp_path, capsys):
    preprocess(tmp_path, "stories")
    capsys.readouterr()
    (tmp_path / "no-tokenizer").mkdir()
    mistakes = [
        (["extract-wiki", "--dump", tmp_path / "missing.xml.bz2", "--output", tmp_path / "x"], "missing.xml.bz2"),
        (["preprocess", "realnews", "--input", tmp_path / "stories", "--output", tmp_path / "rn"], "*.jsonl"),
        (["train-tokenizer", "--input", tmp_path / "stoies", "--output", tmp_path / "tok"], "stoies"),
        (["build-shards", tmp_path / "stoies", "--output", tmp_path / "shards", "--tokenizer",
          tmp_path / "no-tokenizer"], "stoies"),
        (["build-shards", tmp_path / "stories", "--output", tmp_path / "shards", "--tokenizer",
          tmp_path / "no-tokenizer"], "no-tokenizer"),
        (["build-shards", f"{tmp_path / 'stories'}:2", "--output", tmp_path / "shards"], "ratio"),
        (["build-shards", tmp_path / "stories", "--output", tmp_path / "stories" / "part-00000.txt" / "x"],
         "is a file, not a folder"),
        (["preprocess", "stories", "--input", FIXTURES / "stories", "--output", tmp_path / "stories" /
          "part-00000.txt" / "x"], "is a file, not a folder"),
        (["extract-wiki", "--dump", FIXTURES / "stories" / "story-0001.txt", "--output", tmp_path / "x",
          "--processes", "0"], "--processes: must be from 1 to 256, got 0"),
        (["extract-wiki", "--dump", FIXTURES / "stories" / "story-0001.txt", "--output", tmp_path / "x",
          "--bytes", "100K"], "--bytes: a size of at least 200K"),
        (["preprocess", "stories", "--input", FIXTURES / "stories", "--output", tmp_path / "x", "--min-words", "-5"],
         "--min-words must be at least 0, got -5"),
        (["preprocess", "bookcorpus", "--input", FIXTURES / "bookcorpus", "--output", tmp_path / "x",
          "--sentences-per-document", "0"], "--sentences-per-document must be at least 1, got 0"),
        (["preprocess", "stories", "--input", FIXTURES / "stories", "--output", tmp_path / "x",
          "--words-per-partition", "0"], "--words-per-partition must be at least 1, got 0"),
        (["preprocess", "stories", "--input", FIXTURES / "stories", "--output", tmp_path / "x",
          "--document-per-file"], "--document-per-file and --sentences-per-document are bookcorpus options"),
        (["preprocess", "wiki", "--input", FIXTURES / "wiki", "--output", tmp_path / "x",
          "--sentences-per-document", "5"], "are bookcorpus options"),
    ]
    for argv, named in mistakes:
        assert run_command(argv) == 2, argv
        assert_one_error_line(capsys, named)
    assert not any((tmp_path / name).exists() for name in ("x", "rn", "tok", "shards"))


def wiki_files():
    return expand_inputs([FIXTURES / "wiki"], "wiki_*")


class Interrupt(Exception):
    pass


def test_an_interrupted_preprocess_leaves_the_previous_partition_folder_as_it_was(tmp_path):
    out = tmp_path / "wiki"
    write_partitions(wiki_documents(wiki_files(), SkipLog()), out, "wiki", SkipLog(), words_per_partition=1000,
                     min_words=128)
    before = file_states(out)

    def interrupted_after_the_first_partition():
        for i, document in enumerate(wiki_documents(wiki_files(), SkipLog())):
            if i == 3:  # the first new (100-word) partition is complete by now
                raise Interrupt
            yield document

    with pytest.raises(Interrupt):
        write_partitions(interrupted_after_the_first_partition(), out, "wiki", SkipLog(), words_per_partition=100,
                         min_words=128)
    assert file_states(out) == before  # old partitions and old stats.json, no new part-00000 among them
    assert [p.name for p in tmp_path.iterdir()] == ["wiki"]  # no work folder left behind


def test_rerunning_preprocess_on_unchanged_input_touches_no_file(tmp_path):
    preprocess(tmp_path, "wiki", "--words-per-partition", "100")
    before = file_states(tmp_path / "wiki")
    preprocess(tmp_path, "wiki", "--words-per-partition", "100")
    assert file_states(tmp_path / "wiki") == before


def test_a_folder_written_by_an_older_reader_is_redone_by_a_rerun(tmp_path):
    # Readers change what they make of the same input (2026-11-23: wiki text unescaped): the old text must go.
    preprocess(tmp_path, "wiki", "--words-per-partition", "100")
    stats_path = tmp_path / "wiki" / "stats.json"
    stats = json.loads(stats_path.read_text())
    del stats["reader_version"]  # as written before it was recorded
    stats_path.write_text(json.dumps(stats))
    preprocess(tmp_path, "wiki", "--words-per-partition", "100")
    assert json.loads(stats_path.read_text())["reader_version"] >= 2


def test_new_input_rewrites_the_folder_but_unchanged_partitions_keep_their_mtime(tmp_path):
    raw = tmp_path / "raw"
    shutil.copytree(FIXTURES / "stories", raw / "stories")
    argv = ["preprocess", "stories", "--input", raw / "stories", "--output", tmp_path / "stories",
            "--words-per-partition", "1"]  # one story per partition
    assert run_command(argv) == 0
    before = file_states(tmp_path / "stories")
    (raw / "stories" / "story-0009.txt").write_text("A late story, added after the first run.\n")
    assert run_command(argv) == 0
    after = file_states(tmp_path / "stories")
    assert sorted(map(str, after)) == ["part-00000.txt", "part-00001.txt", "part-00002.txt", "stats.json"]
    assert all(after[Path(n)] == before[Path(n)] for n in ("part-00000.txt", "part-00001.txt"))
    assert after[Path("stats.json")] != before[Path("stats.json")]


def test_partition_files_refuse_a_folder_that_does_not_match_its_stats(tmp_path):
    preprocess(tmp_path, "wiki", "--words-per-partition", "100")
    assert len(partition_files(tmp_path / "wiki")) == 3
    with open(tmp_path / "wiki" / "part-00001.txt", "a") as f:
        f.write("A document that preprocess did not write.\n\n")
    with pytest.raises(PartitionError, match="part-00001.txt"):
        partition_files(tmp_path / "wiki")
    (tmp_path / "wiki" / "part-00003.txt").write_text("Another.\n\n")
    with pytest.raises(PartitionError, match="unlisted: part-00003.txt"):
        partition_files(tmp_path / "wiki")


def test_preprocess_refuses_to_replace_a_folder_holding_other_files(tmp_path, capsys):
    (tmp_path / "stories").mkdir()
    (tmp_path / "stories" / "notes.txt").write_text("mine\n")
    code = run_command(["preprocess", "stories", "--input", FIXTURES / "stories", "--output", tmp_path / "stories"])
    assert code == 2
    assert_one_error_line(capsys, "notes.txt")
    assert [p.name for p in (tmp_path / "stories").iterdir()] == ["notes.txt"]


def test_preprocess_and_plot_into_a_folder_they_cannot_write_name_that_folder_not_a_temporary_file(
        tmp_path, capsys, monkeypatch):
    # Both write through hidden temporary files beside the output; the error names what the user gave.
    from nystromformer import atomic
    folder = tmp_path / "ro"
    folder.mkdir()
    access = os.access  # the root user passes permission checks: the file system's answer is stood in for here
    monkeypatch.setattr(atomic.os, "access", lambda p, mode: False if Path(p) == folder else access(p, mode))
    code = run_command(["preprocess", "stories", "--input", FIXTURES / "stories", "--output", folder / "parts"])
    assert code == 2
    assert_one_error_line(capsys, f"--output cannot be written to {folder / 'parts'}: {folder} is not writable")
    from nystromformer.cli import main
    code = main(["plot", "--model-dir", str(tmp_path), "--output", str(folder / "curves.png")])
    assert code == 2
    assert_one_error_line(capsys, f"--output cannot be written to {folder}: {folder} is not writable")
    assert list(folder.iterdir()) == []


def write_books(folder):
    folder.mkdir()
    (folder / "book-a.txt").write_text("Chapter 1\n\nIt was a dark night.\nThe rain fell.\n\nShe waited.\n")
    (folder / "book-b.txt").write_text("Prologue\r\n\r\nThe end came early.\r\n")
    return folder


def test_bookcorpus_with_a_file_per_book_makes_each_file_one_document(tmp_path):
    books = write_books(tmp_path / "books")
    out = tmp_path / "bookcorpus"
    assert run_command(["preprocess", "bookcorpus", "--input", books, "--output", out, "--document-per-file"]) == 0
    documents = [d for p in partition_files(out) for d in read_partition(p)]
    assert documents == ["Chapter 1\nIt was a dark night.\nThe rain fell.\nShe waited.",
                         "Prologue\nThe end came early."]
    assert json.loads((out / "stats.json").read_text())["reader_options"] == {"document_per_file": True}
    # The books_large layout (the default) reads blank lines as document ends: one document per paragraph.
    assert run_command(["preprocess", "bookcorpus", "--input", books, "--output", out]) == 0
    assert len([d for p in partition_files(out) for d in read_partition(p)]) == 5


def test_document_per_file_and_sentences_per_document_do_not_combine(tmp_path, capsys):
    books = write_books(tmp_path / "books")
    code = run_command(["preprocess", "bookcorpus", "--input", books, "--output", tmp_path / "out",
                        "--document-per-file", "--sentences-per-document", "10"])
    assert code == 2
    assert_one_error_line(capsys, "--sentences-per-document")


def test_stories_and_realnews_split_lines_only_at_newlines_like_the_other_readers(tmp_path):
    text = "one\u2028two\x0cthree\x85four\u2029five\r\nnext line\n"
    expected = "one\u2028two\x0cthree\x85four\u2029five\nnext line"
    (tmp_path / "story.txt").write_text(text, newline="")
    (tmp_path / "news.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (tmp_path / "books.txt").write_text(text, newline="")
    assert list(stories_documents([tmp_path / "story.txt"], SkipLog())) == [expected]
    assert list(realnews_documents([tmp_path / "news.jsonl"], SkipLog())) == [expected]
    assert list(bookcorpus_documents([tmp_path / "books.txt"], SkipLog())) == [expected]


def test_a_byte_order_mark_opening_a_file_is_not_text_but_one_inside_a_line_is_kept(tmp_path):
    # Windows editors save UTF-8 with a BOM; tokenized, it would be a token of its own at the document's start.
    text = "\ufeffFirst line of the file\nsecond \ufeff line\n"
    for name in ("story.txt", "books.txt"):
        (tmp_path / name).write_text(text)
    (tmp_path / "news.jsonl").write_text("\ufeff" + json.dumps({"text": "First line of the file"}) + "\n")
    (tmp_path / "extracted").mkdir()
    (tmp_path / "extracted" / "wiki_00").write_text('\ufeff<doc id="1" url="u" title="T">\nT\n\nFirst line of the '
                                                    'file\n</doc>\n')
    expected = ["First line of the file\nsecond \ufeff line"]
    assert list(stories_documents([tmp_path / "story.txt"], SkipLog())) == expected
    assert list(bookcorpus_documents([tmp_path / "books.txt"], SkipLog())) == expected
    assert list(realnews_documents([tmp_path / "news.jsonl"], SkipLog())) == ["First line of the file"]
    assert list(wiki_documents([tmp_path / "extracted" / "wiki_00"], SkipLog())) == ["First line of the file"]
    # and a bad byte after it is reported on its own line
    (tmp_path / "bad.txt").write_bytes(b"\xef\xbb\xbfa\n\xff story\n")
    skips = SkipLog()
    assert list(stories_documents([tmp_path / "bad.txt"], skips)) == []
    assert skips.as_dict()["first_examples"]["undecodable_bytes"][0].startswith(f"{tmp_path / 'bad.txt'}:2:")


def test_lines_lose_their_indentation_and_trailing_spaces_but_keep_their_breaks(tmp_path):
    # (the tokenizer would otherwise spend ids on layout: "  indented" encodes differently from "indented")
    text = "  indented first line  \n\tsecond line\t\n"
    (tmp_path / "story.txt").write_text(text)
    (tmp_path / "news.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (tmp_path / "books.txt").write_text(text)
    expected = ["indented first line\nsecond line"]
    assert list(stories_documents([tmp_path / "story.txt"], SkipLog())) == expected
    assert list(realnews_documents([tmp_path / "news.jsonl"], SkipLog())) == expected
    assert list(bookcorpus_documents([tmp_path / "books.txt"], SkipLog())) == expected


def test_data_commands_are_registered_in_the_cli():
    from nystromformer import cli
    assert "nystromformer.data.commands" in cli.COMMAND_MODULES


def test_a_lone_carriage_return_inside_a_document_is_text_not_a_document_boundary(tmp_path):
    from nystromformer.data.partitions import read_partition
    path = tmp_path / "part-00000.txt"
    path.write_bytes("first line\rsame document\r\rstill the same\n\nsecond document\n\n".encode())
    assert list(read_partition(path)) == ["first line\rsame document\r\rstill the same", "second document"]


# --- The whole-folder swap under interruptions, kills and symlinks -------------------------------------------------

def write_wiki(out, words_per_partition, documents=None):
    documents = wiki_documents(wiki_files(), SkipLog()) if documents is None else documents
    return write_partitions(documents, out, "wiki", SkipLog(), words_per_partition=words_per_partition,
                            min_words=128)


def interrupted_documents():
    """Wiki documents, then an interruption before the run could finish."""
    yield from list(wiki_documents(wiki_files(), SkipLog()))[:1]
    raise Interrupt


def interrupt_rename(monkeypatch, call, after=False):
    """Make the ``call``-th os.rename raise KeyboardInterrupt (as SIGINT would), just before or just after it."""
    rename, calls = os.rename, []

    def interrupted(src, dst):
        calls.append(src)
        if len(calls) == call and not after:
            raise KeyboardInterrupt
        rename(src, dst)
        if len(calls) == call:
            raise KeyboardInterrupt
    monkeypatch.setattr(os, "rename", interrupted)


# A preprocess run in a child process, SIGKILLed at its N-th os.rename: no except or finally clause runs.
KILLED_RUN = """
import os, signal, sys
from nystromformer.data.partitions import write_partitions
from nystromformer.data.readers import SkipLog, expand_inputs, wiki_documents
out, words, kill_at, fixtures = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rename, calls = os.rename, []
def killed(src, dst):
    calls.append(src)
    if len(calls) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    rename(src, dst)
os.rename = killed
documents = wiki_documents(expand_inputs([fixtures], "wiki_*"), SkipLog())
write_partitions(documents, out, "wiki", SkipLog(), words_per_partition=words, min_words=128)
"""


def killed_at_rename(out, words_per_partition, call):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "code")}
    result = subprocess.run([sys.executable, "-c", KILLED_RUN, str(out), str(words_per_partition), str(call),
                             str(FIXTURES / "wiki")], env=env, capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr


def hidden(folder):
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("after", [False, True], ids=["before-second-rename", "after-second-rename"])
def test_an_interrupt_at_the_second_rename_leaves_the_old_or_the_new_folder_never_none(tmp_path, monkeypatch,
                                                                                       after):
    out = tmp_path / "wiki"
    write_wiki(out, 1000)
    before = file_states(out)
    interrupt_rename(monkeypatch, call=2, after=after)  # call 1 moves the old folder aside, call 2 the new one in
    with pytest.raises(KeyboardInterrupt):
        write_wiki(out, 100)
    monkeypatch.undo()
    if after:  # the new folder was in place: it stays, its old one is left for the next run to remove
        assert len(partition_files(out)) == 3
    else:  # the old folder is put back at once and the new one removed
        assert file_states(out) == before and hidden(tmp_path) == []
    write_wiki(out, 1000)
    assert hidden(tmp_path) == [] and len(partition_files(out)) == 1


def test_a_kill_between_the_two_renames_is_repaired_by_the_next_run_even_if_that_run_fails(tmp_path, caplog):
    out = tmp_path / "wiki"
    write_wiki(out, 1000)
    before = file_states(out)
    killed_at_rename(out, 100, call=2)
    assert not out.exists() and len(hidden(tmp_path)) == 2  # .old (the old folder) and .partial (the new one)
    with caplog.at_level("WARNING", logger="nystromformer.data"), pytest.raises(Interrupt):
        write_wiki(out, 100, interrupted_documents())
    assert "restored it from" in caplog.text
    assert file_states(out) == before and hidden(tmp_path) == []  # the old folder, restored before the run failed
    write_wiki(out, 100)
    assert len(partition_files(out)) == 3 and hidden(tmp_path) == []


@pytest.mark.parametrize("how", ["interrupt", "kill"])
@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "existing-folder"])
def test_stopping_a_run_whose_work_folder_is_complete_never_loses_data(tmp_path, monkeypatch, how, existing):
    out = tmp_path / "wiki"
    if existing:
        write_wiki(out, 1000)
    before = file_states(out) if existing else None
    if how == "kill":
        killed_at_rename(out, 100, call=1)  # the work folder is complete, nothing renamed yet
    else:
        interrupt_rename(monkeypatch, call=1)
        with pytest.raises(KeyboardInterrupt):
            write_wiki(out, 100)
        monkeypatch.undo()
    if existing:  # the old folder is untouched
        assert file_states(out) == before
    else:  # no folder yet: the complete new one is kept (hidden) for the next run
        assert not out.exists() and len(hidden(tmp_path)) == 1
    stats = write_wiki(out, 100)
    assert len(partition_files(out)) == 3 and stats["partitions"] == [p.name for p in partition_files(out)]
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("link", ["folder", "parent", "dangling"])
def test_a_symlinked_output_is_swapped_at_the_link_target(tmp_path, link):
    real = tmp_path / "disk"
    real.mkdir()
    if link == "parent":  # --output under a symlinked folder
        (tmp_path / "parts").symlink_to(real)
        out, target = tmp_path / "parts" / "wiki", real / "wiki"
    else:  # --output itself a link, to an existing folder or to one preprocess creates
        out, target = tmp_path / "wiki", real / "wiki"
        if link == "folder":
            target.mkdir()
        out.symlink_to(target)
    write_wiki(out, 1000)
    write_wiki(out, 100)  # replaces a folder: the swap
    assert target.is_dir() and not target.is_symlink() and len(partition_files(target)) == 3
    assert out.is_symlink() if link != "parent" else (tmp_path / "parts").is_symlink()
    assert partition_files(out) and hidden(real) == [] and hidden(tmp_path) == []
    write_wiki(out, 1000)
    assert len(partition_files(out)) == 1 and hidden(real) == []


def test_leftover_symlinks_are_unlinked_not_emptied_and_a_moved_link_is_restored(tmp_path):
    # A version that renamed links left ".wiki.<random>.old" as a symlink to the user's real folder.
    precious = tmp_path / "disk" / "wiki"
    write_wiki(precious, 1000)
    before = file_states(precious)
    out = tmp_path / "wiki"
    write_wiki(out, 1000)
    (tmp_path / ".wiki.abcd1234.old").symlink_to(precious)
    write_wiki(out, 100)
    assert hidden(tmp_path) == [] and file_states(precious) == before
    # With nothing at --output, such a link is what was there: it is moved back and the data swapped at its target.
    shutil.rmtree(out)
    (tmp_path / ".wiki.abcd1234.old").symlink_to(precious)
    write_wiki(out, 100)
    assert out.is_symlink() and out.resolve() == precious.resolve() and len(partition_files(precious)) == 3
    assert hidden(tmp_path) == [] and hidden(precious.parent) == []


def test_an_old_folder_that_cannot_be_removed_after_the_swap_is_a_warning_and_goes_at_the_next_run(
        tmp_path, monkeypatch, caplog):
    out = tmp_path / "wiki"
    write_wiki(out, 1000)
    rmdir = os.rmdir

    def busy(path, *args, **kwargs):  # as on NFS, where a reader's open file keeps a ".nfs..." entry
        if str(path).endswith(".trash"):  # the old folder, renamed for its removal
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        return rmdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "rmdir", busy)
    with caplog.at_level("WARNING", logger="nystromformer.data"):
        write_wiki(out, 100)
    monkeypatch.undo()
    assert len(partition_files(out)) == 3 and len(hidden(tmp_path)) == 1
    assert hidden(tmp_path)[0] in caplog.text
    write_wiki(out, 1000)
    assert hidden(tmp_path) == []


# A run SIGKILLed while removing the old folder after its swap: the removal has taken stats.json and one partition.
KILLED_REMOVING_OLD = """
import os, shutil, signal, sys
from pathlib import Path
from nystromformer.data.partitions import write_partitions
from nystromformer.data.readers import SkipLog, expand_inputs, wiki_documents
out, fixtures = sys.argv[1], sys.argv[2]
def killed(path, *args, **kwargs):
    (Path(path) / "stats.json").unlink()
    sorted(Path(path).glob("part-*.txt"))[0].unlink()
    os.kill(os.getpid(), signal.SIGKILL)
shutil.rmtree = killed
documents = wiki_documents(expand_inputs([fixtures], "wiki_*"), SkipLog())
write_partitions(documents, out, "wiki", SkipLog(), words_per_partition=100, min_words=128)
"""


def test_a_half_removed_old_folder_is_never_restored(tmp_path, caplog):
    out = tmp_path / "wiki"
    write_wiki(out, 60)  # several partitions: one removed leaves a folder of partitions without its stats.json
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "code")}
    result = subprocess.run([sys.executable, "-c", KILLED_REMOVING_OLD, str(out), str(FIXTURES / "wiki")], env=env,
                            capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr
    [trash] = hidden(tmp_path)
    assert trash.endswith(".trash") and len(partition_files(out)) == 3  # swapped in, then killed removing the old
    assert len(partition_files(tmp_path / trash)) >= 1  # readable, had it been restored: stats.json is optional
    shutil.rmtree(out)  # by hand
    with pytest.raises(Interrupt):
        write_wiki(out, 100, interrupted_documents())
    assert not out.exists() and hidden(tmp_path) == []  # the half folder was removed, not restored
    # The same half folder under a .old name (left by a version that removed it in place): kept, not restored.
    half = tmp_path / ".wiki.abcd1234.old"
    write_wiki(half, 60)
    (half / "stats.json").unlink()
    (half / "part-00000.txt").unlink()
    with caplog.at_level("WARNING", logger="nystromformer.data"), pytest.raises(Interrupt):
        write_wiki(out, 100, interrupted_documents())
    assert not out.exists() and hidden(tmp_path) == [half.name] and "not restored" in caplog.text
    assert f"{half}" in caplog.text
    write_wiki(out, 100)  # output still missing at its start: kept, the new folder written
    assert len(partition_files(out)) == 3 and hidden(tmp_path) == [half.name]
    write_wiki(out, 1000)  # a run that finds the folder in place removes it
    assert len(partition_files(out)) == 1 and hidden(tmp_path) == []


@pytest.mark.parametrize("how", ["mount-point", "other-file-system"])
def test_an_output_folder_that_is_a_mount_point_is_refused_before_any_input_is_read(tmp_path, monkeypatch, how):
    from nystromformer.data import partitions
    out = tmp_path / "wiki"
    write_wiki(out, 1000)
    before = file_states(out)
    if how == "mount-point":  # e.g. `docker run -v /host/wiki:/data/wiki`: a real mount needs root
        ismount = os.path.ismount
        monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == out or ismount(path))
    else:
        file_system = partitions._file_system
        inside = lambda path: out in (Path(path), *Path(path).parents)  # noqa: E731
        monkeypatch.setattr(partitions, "_file_system", lambda path: file_system(path) + inside(path))
    read = []

    def documents():
        read.append(True)
        yield from wiki_documents(wiki_files(), SkipLog())
    with pytest.raises(PartitionError, match=rf"{out}: is a mount point.*--output, e\.g\. {out / 'wiki'}"):
        write_wiki(out, 100, documents())
    assert not read and file_states(out) == before and hidden(tmp_path) == []
    write_wiki(out / "wiki", 100, documents())  # a folder inside the mount is what to give
    assert len(partition_files(out / "wiki")) == 3


def test_an_unexpected_missing_file_is_a_bug_with_a_traceback_not_a_user_error(tmp_path, monkeypatch):
    def vanished(src, dst):  # a temporary file removed behind the writer's back
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(src))
    monkeypatch.setattr(os, "replace", vanished)
    with pytest.raises(FileNotFoundError):
        run_command(["preprocess", "stories", "--input", FIXTURES / "stories", "--output", tmp_path / "stories"])


@pytest.mark.parametrize("argv, named", [
    (["preprocess", "stories", "--input", FIXTURES / "stories", "--min-words", "99999999"],
     "error: stories: no document kept (2 read, 2 empty or under 99999999 words; skipped "),
    (["preprocess", "realnews", "--input", FIXTURES / "stories" / "story-0001.txt"],
     "error: realnews: no document kept (0 read"),
])
def test_a_preprocess_that_keeps_no_document_fails_and_keeps_the_folder_it_would_replace(tmp_path, capsys, argv,
                                                                                          named):
    preprocess(tmp_path, "stories")  # a good folder at the output
    out = tmp_path / "stories"
    before = file_states(out)
    capsys.readouterr()
    assert run_command([*argv, "--output", out]) == 2
    err = capsys.readouterr().err  # after the progress bar: the reading had to happen to know
    assert err.splitlines()[-1].startswith(named) and "Traceback" not in err, err
    assert file_states(out) == before


@pytest.mark.parametrize("flags, named", [
    (["--vocab-size", "100"], "--vocab-size: must be from 261 (the 256 bytes and the 5 special tokens) to"),
    (["--vocab-size", "100000000000"], "--vocab-size: must be from 261"),
    (["--min-frequency", "0"], "--min-frequency: must be at least 1, got 0"),
])
def test_tokenizer_sizes_the_trainer_would_ignore_or_crash_on_are_one_error_line(tmp_path, capsys, flags, named):
    preprocess(tmp_path, "stories")
    capsys.readouterr()
    assert run_command(["train-tokenizer", "--input", tmp_path / "stories", "--output", tmp_path / "tok",
                        *flags]) == 2
    assert_one_error_line(capsys, named)
    assert not (tmp_path / "tok").exists()


def test_training_a_tokenizer_into_a_folder_that_holds_one_needs_overwrite(tmp_path, capsys):
    preprocess(tmp_path, "stories")
    argv = ["train-tokenizer", "--input", tmp_path / "stories", "--output", tmp_path / "tok", "--vocab-size", "300"]
    assert run_command(argv) == 0
    before = (tmp_path / "tok" / "vocab.json").read_bytes()
    capsys.readouterr()
    assert run_command(argv[:-1] + ["280"]) == 2
    assert_one_error_line(capsys, f"--output {tmp_path / 'tok'}: holds a tokenizer already (vocab.json, merges.txt)")
    assert (tmp_path / "tok" / "vocab.json").read_bytes() == before
    assert run_command(argv[:-1] + ["280", "--overwrite"]) == 0
    assert len(json.loads((tmp_path / "tok" / "vocab.json").read_text())) == 280


def test_a_partition_file_changed_by_hand_into_other_bytes_or_stats_is_an_error_naming_it(tmp_path):
    from nystromformer.data.partitions import PartitionError, partition_files
    preprocess(tmp_path, "stories")
    folder = tmp_path / "stories"
    (folder / "stats.json").write_text("[1, 2]")
    with pytest.raises(PartitionError, match=r"stats.json: not a preprocess stats file"):
        partition_files(folder)
    part = folder / "part-00000.txt"
    part.write_bytes(b"First document.\n\nSecond, caf\xe9.\n")
    with pytest.raises(PartitionError, match=r"part-00000.txt:3: not UTF-8"):
        list(read_partition(part))


def test_a_tokenizer_folder_with_broken_files_is_an_error_naming_the_folder(tmp_path):
    from nystromformer.tokenizer import TokenizerError, load_tokenizer
    (tmp_path / "vocab.json").write_text("{broken")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(TokenizerError, match=f"{tmp_path}: unreadable tokenizer files"):
        load_tokenizer(tmp_path)


def test_of_several_complete_folders_moved_aside_by_killed_swaps_the_newest_is_restored(tmp_path, caplog):
    # Each crashed swap can leave a complete .old (one whose removal failed stays while the folder is in place; the
    # next swap killed between its renames leaves another): the one renamed aside last is what was at --output.
    out = tmp_path / "wiki"
    newest, stale = tmp_path / ".wiki.aaaaaaaa.old", tmp_path / ".wiki.zzzzzzzz.old"
    write_wiki(newest, 1000)    # written first, moved aside last: neither its name nor its mtime makes it the newest
    time.sleep(0.05)
    write_wiki(stale, 100)
    expected = file_states(newest)
    for folder in (stale, newest):  # a rename sets the folder's ctime
        staging = folder.with_name("staging")
        folder.rename(staging)
        time.sleep(0.05)
        staging.rename(folder)
    assert stale.lstat().st_ctime_ns < newest.lstat().st_ctime_ns, "a rename did not set the folder's ctime here"
    assert stale.stat().st_mtime_ns > newest.stat().st_mtime_ns
    with caplog.at_level("WARNING", logger="nystromformer.data"), pytest.raises(Interrupt):
        write_wiki(out, 100, interrupted_documents())   # restores before it reads, then fails
    assert f"restored it from {newest.name}" in caplog.text
    assert file_states(out) == expected and len(partition_files(out)) == 1
    assert hidden(tmp_path) == []  # the stale one is removed




def record_renames_and_fsyncs(monkeypatch):
    """os.rename and os.fsync still do their work; each call is recorded, with the names or the fsynced path."""
    events, rename, fsync = [], os.rename, os.fsync

    def recorded_rename(src, dst):
        rename(src, dst)
        events.append(("rename", Path(src).name, Path(dst).name))

    def recorded_fsync(fd):
        fsync(fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    monkeypatch.setattr(os, "rename", recorded_rename)
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    return events


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fsynced file from /proc/self/fd")
def test_a_swapped_in_or_restored_folder_is_made_durable_by_an_fsync_of_its_parent_before_the_old_one_goes(
        tmp_path, monkeypatch):
    out = tmp_path / "wiki"
    write_wiki(out, 1000)
    events = record_renames_and_fsyncs(monkeypatch)
    write_wiki(out, 100)
    monkeypatch.undo()
    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    [aside, swap_in, to_trash] = renames   # old folder aside, new one in, old one renamed for its removal
    assert events[aside][1] == "wiki" and events[aside][2].endswith(".old")
    assert events[swap_in][1].endswith(".partial") and events[swap_in][2] == "wiki"
    assert events[to_trash][2].endswith(".trash")
    assert ("fsync", str(tmp_path.resolve())) in events[swap_in + 1:to_trash], events[aside:]
    assert len(partition_files(out)) == 3

    # The restore of a folder a killed swap had moved aside is made durable in the same way.
    out.rename(tmp_path / ".wiki.abcd1234.old")
    events = record_renames_and_fsyncs(monkeypatch)
    with pytest.raises(Interrupt):
        write_wiki(out, 1000, interrupted_documents())
    monkeypatch.undo()
    restore = events.index(("rename", ".wiki.abcd1234.old", "wiki"))
    assert events[restore + 1:restore + 2] == [("fsync", str(tmp_path.resolve()))], events
    assert len(partition_files(out)) == 3


@pytest.mark.parametrize("where", [".", "parts"])
def test_partitions_cannot_be_written_into_their_input_folder(tmp_path, capsys, where):
    # the stories reader takes every *.txt below its folder: a partition file written there would be read back
    # as one more story on the next run (the folder never up to date, the corpus growing by a copy each time)
    stories = tmp_path / "stories"
    shutil.copytree(FIXTURES / "stories", stories)
    before = sorted(p.relative_to(stories) for p in stories.rglob("*"))
    output = (stories / where).resolve() if where == "." else stories / where
    assert run_command(["preprocess", "stories", "--input", stories, "--output", output]) == 2
    assert capsys.readouterr().err == (f"error: --output {output}: is inside the input folder {stories}; write it "
                                       f"elsewhere (its files would be read back as input)\n")
    assert sorted(p.relative_to(stories) for p in stories.rglob("*")) == before


def test_rerunning_preprocess_with_the_input_spelled_another_way_touches_no_file(tmp_path, monkeypatch):
    preprocess(tmp_path, "wiki", "--words-per-partition", "100")  # the input as an absolute path
    before = file_states(tmp_path / "wiki")
    monkeypatch.chdir(FIXTURES)  # the same files, named relative to here: compared by absolute path, size and mtime
    assert run_command(["preprocess", "wiki", "--input", "wiki", "--output", tmp_path / "wiki",
                        "--words-per-partition", "100"]) == 0
    assert file_states(tmp_path / "wiki") == before


def test_a_new_partition_folder_gets_a_new_folders_permissions_and_a_replaced_one_keeps_its_own(tmp_path):
    old_umask = os.umask(0o022)
    try:
        write_partitions(iter(["a b c"]), tmp_path / "p", "wiki", SkipLog())
        assert (tmp_path / "p").stat().st_mode & 0o7777 == 0o755  # not the work folder's 0700 (mkdtemp)
        os.chmod(tmp_path / "p", 0o750)
        write_partitions(iter(["d e f"]), tmp_path / "p", "wiki", SkipLog())
        assert (tmp_path / "p").stat().st_mode & 0o7777 == 0o750
    finally:
        os.umask(old_umask)


def test_an_empty_document_is_too_short_even_when_min_words_is_0(tmp_path):
    stats = write_partitions(iter(["a b", "", " \n ", "c"]), tmp_path / "p", "stories", SkipLog(), min_words=0)
    assert (stats["documents_kept"], stats["documents_too_short"], stats["words"]) == (2, 2, 3)
    assert list(read_partition(tmp_path / "p" / "part-00000.txt")) == ["a b", "c"]
