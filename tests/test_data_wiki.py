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

    shards = tmp_path / "shards"
    build = ["build-shards", tmp_path / "wiki", "--output", shards, "--tokenizer", roberta,
             "--seq-len", SEQ_LEN, "--shard-size", 1000]
    assert run_command(build + ["--workers", 2]) == 0
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
    assert run_command(build + ["--workers", 1]) == 0  # a re-run (with other worker count) is a no-op
    assert file_states(shards) == before
