"""The real enwiki sample dump through wikiextractor -> partitions -> RoBERTa shards, via the commands."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from nystromformer.shards import ShardedSequences
from test_data_readers import run_command

SEQ_LEN = 128


def file_states(folder):
    return {p.relative_to(folder): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_real_wiki_dump_becomes_valid_resumable_shards(shared_dir, tmp_path):
    dump = shared_dir / "data" / "wiki" / "enwiki-sample-pages-articles.xml.bz2"
    roberta = shared_dir / "tokenizers" / "roberta-base"
    if not dump.is_file() or not (roberta / "vocab.json").is_file():
        pytest.skip(f"needs {dump} and {roberta}")

    assert run_command(["extract-wiki", "--dump", dump, "--output", tmp_path / "extracted", "--processes", 2]) == 0
    extracted = list((tmp_path / "extracted").rglob("wiki_*"))
    assert extracted and "<doc id=" in extracted[0].read_text()

    assert run_command(["preprocess", "wiki", "--input", tmp_path / "extracted", "--output", tmp_path / "wiki",
                        "--words-per-partition", 100_000]) == 0
    wiki_stats = json.loads((tmp_path / "wiki" / "stats.json").read_text())
    assert wiki_stats["documents_kept"] > 50 and len(wiki_stats["partitions"]) >= 3
    assert wiki_stats["skipped"]["counts"] == {}  # wikiextractor's own output is well formed
    text = "".join(p.read_text() for p in sorted((tmp_path / "wiki").glob("part-*.txt")))
    assert "AT&T" in text and "&amp;" not in text and "&lt;" not in text  # wikiextractor's escaping undone
    assert "onlyinclude>" not in text  # a transclusion tag of one page

    shards = tmp_path / "shards"

    def build(output, workers):  # runs of 8 × 510 tokens, as the demo's: ~100 runs, each drawn dev or train
        return run_command(["build-shards", tmp_path / "wiki", "--output", output, "--tokenizer", roberta,
                            "--seq-len", SEQ_LEN, "--shard-size", 1000, "--dev-run", 8, "--workers", workers])

    assert build(shards, workers=2) == 0
    meta = json.loads((shards / "meta.json").read_text())
    assert meta["vocab_size"] == 50265 and meta["special_tokens"]["mask"] == 50264 and meta["dtype"] == "uint16"
    total = 0
    for split in ("train", "dev"):
        data = ShardedSequences(shards, split)
        rows = data.rows(np.arange(len(data)))
        assert rows.shape == (len(data), SEQ_LEN) and len(data) > 0
        assert (rows[:, 0] == 0).all() and (rows[:, -1] == 2).all() and rows.max() < 50265
        total += len(data)
    stats = json.loads((shards / "stats.json").read_text())
    assert stats["datasets"]["wiki"]["documents"] == wiki_stats["documents_kept"]
    assert stats["train_sequences"] + stats["dev_sequences"] == total

    before = file_states(shards)
    assert build(shards, workers=1) == 0  # a re-run (with other worker count) is a no-op
    assert file_states(shards) == before
    # One process gives the same shards: a fresh build, since the re-run above skipped every partition.
    in_process = tmp_path / "shards-in-process"
    assert build(in_process, workers=1) == 0
    for split in ("train", "dev"):
        parallel, single = ShardedSequences(shards, split), ShardedSequences(in_process, split)
        assert np.array_equal(parallel.rows(np.arange(len(parallel))), single.rows(np.arange(len(single))))
    assert json.loads((in_process / "stats.json").read_text()) == stats


DEMO_DUMP = Path(__file__).resolve().parents[1] / "demo" / "sample-pages-articles.xml.bz2"


def test_extract_wiki_bytes_zero_writes_one_article_per_file_as_wikiextractor_does(tmp_path):
    assert run_command(["extract-wiki", "--dump", DEMO_DUMP, "--output", tmp_path, "--processes", 1,
                        "--bytes", "0"]) == 0
    articles = [f.read_text().count("<doc ") for f in tmp_path.rglob("wiki_*")]
    # wikiextractor leaves its first file empty at --bytes 0 (preprocess counts it as an empty file)
    assert sorted(set(articles)) == [0, 1] and articles.count(0) == 1 and articles.count(1) > 100


@pytest.mark.parametrize("spelling,size", [("0", 0), ("200K", 200 * 1024), ("100M", 100 * 1024 ** 2),
                                           ("100m", 100 * 1024 ** 2), ("1G", 1024 ** 3)])
def test_extract_wiki_takes_the_sizes_wikiextractor_takes(spelling, size):
    from nystromformer.data.wiki import _file_size
    assert _file_size(spelling) == size


@pytest.mark.parametrize("spelling", ["100MB", "1.5G", "3000000", "100", "-1M", "1 G", ""])
def test_extract_wiki_refuses_sizes_wikiextractor_would_reject_or_misread(tmp_path, capsys, spelling):
    # wikiextractor drops the last character as the unit: "100MB" fails after it starts (exit 0, nothing
    # written), and bare digits lose their last one ("3000000" would be 300,000 bytes)
    assert run_command(["extract-wiki", "--dump", DEMO_DUMP, "--output", tmp_path / "x", f"--bytes={spelling}"]) == 2
    assert "--bytes: a size of at least 200K" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_file_that_is_no_wiki_dump_is_an_error_after_wikiextractor_finds_no_article(tmp_path, capsys):
    import bz2
    dump = tmp_path / "not-a-dump.xml.bz2"
    dump.write_bytes(bz2.compress(b"some text, not MediaWiki XML\n"))
    assert run_command(["extract-wiki", "--dump", dump, "--output", tmp_path / "out", "--processes", 1]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"error: {dump}: wikiextractor found no article in it "
                                    f"(is it a pages-articles XML dump?)"), err


def test_a_failing_wikiextractor_fails_the_command_with_its_exit_status(tmp_path, caplog):
    import bz2
    dump = tmp_path / "truncated.xml.bz2"
    whole = bz2.compress(b"<mediawiki>" + b"<page><title>A</title></page>" * 2000)
    dump.write_bytes(whole[: len(whole) // 2])  # a cut download: wikiextractor's reader raises, make must not stamp
    assert run_command(["extract-wiki", "--dump", dump, "--output", tmp_path / "out", "--processes", 1]) == 1
    assert f"wikiextractor failed on {dump} with exit code 1 (its message is above; a damaged or truncated " \
           f"download? `bzip2 -t {dump}` checks a .bz2 file)" in caplog.text


def test_a_dump_named_bz2_that_is_not_bzip2_data_is_one_error_line_before_wikiextractor_runs(tmp_path, capsys):
    dump = tmp_path / "enwiki-latest-pages-articles.xml.bz2"
    dump.write_bytes(b"<html>404 Not Found</html>")
    assert run_command(["extract-wiki", "--dump", dump, "--output", tmp_path / "out", "--processes", 1]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {dump}: not bzip2 data (a .bz2 file begins with 'BZh', this one with b'<ht'): an "
                   f"incomplete download, or a web page saved under the dump's name?\n")
    assert not (tmp_path / "out").exists()


def test_extracting_again_into_a_folder_of_an_earlier_extraction_is_refused_unless_overwrite_deletes_it(
        tmp_path, capsys):
    # wikiextractor writes over same-named files and leaves the rest: a second extraction with larger files into
    # the same folder would leave the first one's later files, and preprocess would read those articles twice
    out = tmp_path / "extracted"
    assert run_command(["extract-wiki", "--dump", DEMO_DUMP, "--output", out, "--processes", 1, "--bytes", "0"]) == 0
    first = sorted(f.relative_to(out) for f in out.rglob("wiki_*"))
    articles = sum((out / f).read_text().count("<doc ") for f in first)
    assert len(first) > 100
    assert run_command(["extract-wiki", "--dump", DEMO_DUMP, "--output", out, "--processes", 1]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --output {out}: holds {len(first)} wiki_* file(s) of an earlier extraction (e.g. {first[0]}), which "
        f"preprocess would read beside the new ones; extract into a new folder, or add --overwrite to delete them "
        f"first")
    assert sorted(f.relative_to(out) for f in out.rglob("wiki_*")) == first      # untouched
    assert run_command(["extract-wiki", "--dump", DEMO_DUMP, "--output", out, "--processes", 1, "--overwrite"]) == 0
    again = sorted(f.relative_to(out) for f in out.rglob("wiki_*"))
    assert again == [Path("AA") / "wiki_00"]                                      # the one 100M file, nothing else
    assert (out / "AA" / "wiki_00").read_text().count("<doc ") == articles         # each article once


def test_overwrite_deletes_the_earlier_wiki_files_and_keeps_what_else_their_folders_hold(tmp_path):
    out = tmp_path / "extracted"
    (out / "AB").mkdir(parents=True)
    (out / "AB" / "wiki_00").write_text('<doc id="1" url="u" title="t">\nt\nold\n</doc>\n')
    (out / "AB" / "notes.txt").write_text("not wikiextractor's")
    assert run_command(["extract-wiki", "--dump", DEMO_DUMP, "--output", out, "--processes", 1, "--overwrite"]) == 0
    assert not (out / "AB" / "wiki_00").exists() and (out / "AB" / "notes.txt").read_text() == "not wikiextractor's"
    assert sorted(f.relative_to(out) for f in out.rglob("wiki_*")) == [Path("AA") / "wiki_00"]
