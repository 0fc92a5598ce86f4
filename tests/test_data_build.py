"""Tokeniser training and shard building: exact-length sequences, deterministic, idempotent, resumable."""
import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from nystromformer.data.build import BuildError, build_shards, dev_split_warning, parse_dataset
from nystromformer.data.partitions import PartitionError, partition_files, read_partition, write_partitions
from nystromformer.data.readers import READERS, SkipLog, expand_inputs, INPUT_PATTERNS
from nystromformer.data.tokenize import train_tokenizer
from nystromformer.shards import ShardedSequences
from nystromformer.tokenizer import TokenizerError, load_tokenizer, special_token_ids

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "data"


@pytest.fixture(scope="module")
def partitions(tmp_path_factory):
    """Fixture corpora as partition folders, several small partitions each."""
    root = tmp_path_factory.mktemp("partitions")
    for dataset in ("wiki", "bookcorpus", "stories", "realnews"):
        files = expand_inputs([FIXTURES / dataset], INPUT_PATTERNS[dataset])
        write_partitions(READERS[dataset](files, SkipLog()), root / dataset, dataset, SkipLog(),
                         words_per_partition=150, min_words=0)
    return root


@pytest.fixture(scope="module")
def trained_tokenizer(partitions, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer([partitions / d for d in ("wiki", "bookcorpus", "stories", "realnews")], out,
                    vocab_size=400, min_frequency=1)
    return out


def test_trained_tokenizer_loads_with_roberta_special_token_ids(trained_tokenizer):
    names = {p.name for p in trained_tokenizer.iterdir()}
    assert {"vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json"} <= names
    tok = load_tokenizer(trained_tokenizer)
    assert len(tok) == 400
    assert special_token_ids(tok) == {"bos": 0, "pad": 1, "eos": 2, "unk": 3, "mask": 399}
    text = "The ferry timetable changes twice a year."
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text and max(ids) < 399
    assert tok("<mask>", add_special_tokens=False).input_ids == [399]


def shard_arrays(folder):
    return {split: ShardedSequences(folder, split) for split in ("train", "dev")}


def all_rows(folder, split):
    data = ShardedSequences(folder, split)
    return data.rows(np.arange(len(data)))


def file_states(folder):
    return {p.relative_to(folder): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def build(partitions, tokenizer, out, seq_len=32, datasets=("wiki", "bookcorpus", "stories", "realnews"), **kw):
    specs = [parse_dataset(str(partitions / d)) if ":" not in d else parse_dataset(str(partitions) + "/" + d)
             for d in datasets]
    return build_shards(specs, out, str(tokenizer), seq_len=seq_len, shard_size=kw.pop("shard_size", 8), **kw)


@pytest.mark.parametrize("seq_len", [16, 64])
def test_every_sequence_has_seq_len_ids_wrapped_in_bos_eos_below_vocab_size(partitions, trained_tokenizer,
                                                                             tmp_path, seq_len):
    stats = build(partitions, trained_tokenizer, tmp_path, seq_len=seq_len)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["max_seq_len"] == seq_len and meta["vocab_size"] == 400 and meta["tokenizer"] == str(trained_tokenizer)
    assert meta["special_tokens"] == {"bos": 0, "eos": 2, "pad": 1, "mask": 399, "unk": 3}
    for split in ("train", "dev"):
        rows = all_rows(tmp_path, split)
        assert rows.shape[1] == seq_len and len(rows) == stats[f"{split}_sequences"] > 0
        assert (rows[:, 0] == 0).all() and (rows[:, -1] == 2).all()
        assert rows.min() >= 0 and rows.max() < 400
        assert not np.isin(rows[:, 1:-1], [0, 1, 399]).any()  # no <s>, <pad> or <mask> inside blocks
    for name, d in stats["datasets"].items():
        assert d["sequences"] == d["train_sequences"] + d["dev_sequences"]
        # tokens + separators between documents = full blocks + the dropped tail, per partition file
        assert d["tokens"] + d["documents"] - d["partition_files"] == d["sequences"] * (seq_len - 2) + d["tokens_dropped_tail"]


def test_sequences_are_contiguous_document_tokens_with_eos_between_documents(partitions, trained_tokenizer, tmp_path):
    build(partitions, trained_tokenizer, tmp_path, datasets=("stories",), dev_fraction=0.0, shard_size=1000)
    tok = load_tokenizer(trained_tokenizer)
    from nystromformer.data.partitions import partition_files, read_partition
    expected = []
    for path in partition_files(partitions / "stories"):
        stream = []
        for i, doc in enumerate(read_partition(path)):
            stream += ([2] if i else []) + tok(doc, add_special_tokens=False).input_ids
        expected += stream[: len(stream) // 30 * 30]
    rows = all_rows(tmp_path, "train")
    assert rows[:, 1:-1].reshape(-1).tolist() == expected


def test_shard_size_bounds_rows_per_shard(partitions, trained_tokenizer, tmp_path):
    build(partitions, trained_tokenizer, tmp_path, shard_size=5)
    index = json.loads((tmp_path / "train.json").read_text())
    assert max(s["num_sequences"] for s in index["shards"]) == 5
    assert index["num_sequences"] == sum(s["num_sequences"] for s in index["shards"])


def test_dev_split_is_deterministic_whatever_the_workers_about_a_tenth_and_depends_on_the_seed(
        partitions, trained_tokenizer, tmp_path):
    a = build(partitions, trained_tokenizer, tmp_path / "a", seq_len=16, workers=1, dev_run=1)
    # in spawned processes, which finish the files in any order
    b = build(partitions, trained_tokenizer, tmp_path / "b", seq_len=16, workers=2, dev_run=1)
    c = build(partitions, trained_tokenizer, tmp_path / "c", seq_len=16, seed=1, dev_run=1)
    for split in ("train", "dev"):
        assert np.array_equal(all_rows(tmp_path / "a", split), all_rows(tmp_path / "b", split))
    assert not np.array_equal(all_rows(tmp_path / "a", "dev"), all_rows(tmp_path / "c", "dev"))
    assert 0.05 < a["dev_sequences"] / (a["train_sequences"] + a["dev_sequences"]) < 0.15
    assert a == b and a["train_sequences"] + a["dev_sequences"] == c["train_sequences"] + c["dev_sequences"]


def one_big_partition(partitions, folder):
    """Every fixture document in one partition file: its token stream is cut in bulk (64 blocks) many times."""
    documents = [d for name in ("wiki", "stories", "realnews", "bookcorpus")
                 for p in partition_files(partitions / name) for d in read_partition(p)]
    write_partitions(iter(documents), folder / "big", "big", SkipLog(), words_per_partition=10 ** 9)
    return folder


@pytest.mark.parametrize("source", ["small-partitions", "one-big-partition"])
def test_dev_takes_whole_runs_of_text(partitions, trained_tokenizer, tmp_path, source):
    # As the paper's pipeline sent whole files of 8,192 consecutive sequences to dev: dev text seldom neighbours
    # trained text. A run is --dev-run × 510 tokens of a file's token stream. With every sequence in train the
    # shards hold each file's sequences in order.
    root, dataset = (partitions, "wiki") if source == "small-partitions" else (
        one_big_partition(partitions, tmp_path), "big")
    order = build(root, trained_tokenizer, tmp_path / "order", seq_len=16, datasets=(dataset,),
                  dev_fraction=0.0, shard_size=1000)
    assert order["dev_sequences"] == 0
    rows = all_rows(tmp_path / "order", "train")
    index = {tuple(r): i for i, r in enumerate(rows)}
    if source == "one-big-partition":
        assert len(rows) > 3 * 64
    stats = build(root, trained_tokenizer, tmp_path / "runs", seq_len=16, datasets=(dataset,),
                  dev_fraction=0.4, dev_run=1)
    # Rows that occur twice in the text (a repeated 14-token block) are placed by their first occurrence only.
    repeated = {r for r, n in Counter(map(tuple, rows)).items() if n > 1}
    dev = {index[tuple(r)] for r in all_rows(tmp_path / "runs", "dev") if tuple(r) not in repeated}
    train = {index[tuple(r)] for r in all_rows(tmp_path / "runs", "train") if tuple(r) not in repeated}
    assert dev and train and not dev & train
    assert stats["train_sequences"] + stats["dev_sequences"] + stats["datasets"][dataset]["sequences_across_splits"] \
        == len(rows)  # every sequence in one split, or counted as across a dev/train boundary
    # Runs are counted per partition file, from its first token: the sequences inside run k are all dev or all train.
    files = json.loads((tmp_path / "order" / "train.json").read_text())["shards"]
    starts, first = [], 0
    for shard in files:                      # shard names: <dataset>--<part>-train-<k>.npy, in file order
        part = shard["file"].rsplit("-train-", 1)[0]
        if not starts or starts[-1][0] != part:
            starts.append((part, first))
        first += shard["num_sequences"]
    bounds = [b for _, b in starts] + [len(index)]
    runs_checked = 0
    for lo, hi in zip(bounds, bounds[1:]):
        inside: dict = {}
        for i in range(lo, hi):
            first_run, last_run = (i - lo) * 14 // 510, ((i - lo) * 14 + 13) // 510
            if first_run == last_run:
                inside.setdefault(first_run, set()).add(i)
        for members in inside.values():
            assert not (members & dev and members & train), sorted(members & dev)
            runs_checked += bool(members & (dev | train))
    assert runs_checked > 3


def test_builds_of_two_lengths_never_put_one_lengths_dev_text_in_the_others_train_split(partitions,
                                                                                       trained_tokenizer, tmp_path):
    # A 4096 model warm-started from a 512 one is evaluated on its dev split: that text must not be in the 512
    # training data. Runs are measured in tokens (dev_run × 510), the same at every length.
    root = one_big_partition(partitions, tmp_path)
    spans = {}
    for seq_len in (16, 64):
        block = seq_len - 2
        build(root, trained_tokenizer, tmp_path / f"order{seq_len}", seq_len=seq_len, datasets=("big",),
              dev_fraction=0.0, shard_size=100000)
        rows = all_rows(tmp_path / f"order{seq_len}", "train")  # every sequence, in the file's order
        repeated = {r for r, n in Counter(map(tuple, rows)).items() if n > 1}
        start = {tuple(r): i * block for i, r in enumerate(rows) if tuple(r) not in repeated}
        stats = build(root, trained_tokenizer, tmp_path / f"split{seq_len}", seq_len=seq_len, datasets=("big",),
                      dev_fraction=0.5, dev_run=1, shard_size=100000, seed=3)
        for split in ("train", "dev"):
            spans[seq_len, split] = [(start[tuple(r)], start[tuple(r)] + block)
                                     for r in all_rows(tmp_path / f"split{seq_len}", split) if tuple(r) in start]
            assert spans[seq_len, split]
        # a sequence partly in a dev run and partly in a train run is in neither split, and counted
        across = stats["datasets"]["big"]["sequences_across_splits"]
        assert stats["train_sequences"] + stats["dev_sequences"] + across == len(rows)

    def overlap(a, b):
        return [(x, y) for x in a for y in b if x[0] < y[1] and y[0] < x[1]]
    assert not overlap(spans[64, "dev"], spans[16, "train"]) and not overlap(spans[16, "dev"], spans[64, "train"])
    assert overlap(spans[64, "dev"], spans[16, "dev"])  # the same text in dev at both lengths


def test_a_folder_built_before_dev_runs_resumes_only_with_its_per_sequence_split(partitions, trained_tokenizer,
                                                                                 tmp_path):
    build(partitions, trained_tokenizer, tmp_path, seq_len=16, dev_run=1)
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["dev_run"]                      # as such a build wrote it
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(BuildError, match="dev_run"):
        build(partitions, trained_tokenizer, tmp_path, seq_len=16)
    build(partitions, trained_tokenizer, tmp_path, seq_len=16, dev_run=1)


@pytest.mark.parametrize("seq_len, same_split", [(512, True), (16, False)])
def test_a_folder_built_with_runs_of_its_own_sequences_resumes_only_where_that_is_the_same_split(
        partitions, trained_tokenizer, tmp_path, seq_len, same_split):
    # Before runs were measured in tokens, a run was dev_run of the build's own sequences: at 512 (510 tokens of
    # text each) that is the same split, at any other length it is not.
    build(partitions, trained_tokenizer, tmp_path, seq_len=seq_len, dev_run=2)
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["dev_run_unit"]                 # as such a build wrote it
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    if same_split:
        build(partitions, trained_tokenizer, tmp_path, seq_len=seq_len, dev_run=2)
    else:
        with pytest.raises(BuildError, match=r"other settings \(dev_run_unit: \d+ there, 510 now\)"):
            build(partitions, trained_tokenizer, tmp_path, seq_len=seq_len, dev_run=2)


def test_a_folder_built_when_special_token_text_became_special_ids_is_not_resumed(partitions, trained_tokenizer,
                                                                                  tmp_path):
    # Its shards encode "</s>" in the text as a document boundary: new shards beside them would not.
    build(partitions, trained_tokenizer, tmp_path, seq_len=16)
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["special_token_text"]           # as such a build wrote it
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(BuildError, match=r"other settings \(special_token_text: \"as the special id\" there, "
                                         r"\"as text\" now\)"):
        build(partitions, trained_tokenizer, tmp_path, seq_len=16)


def test_sampling_ratio_keeps_a_seeded_subset_of_a_datasets_sequences(partitions, trained_tokenizer, tmp_path):
    full = build(partitions, trained_tokenizer, tmp_path / "full", datasets=("realnews",), dev_fraction=0.0)
    third = build(partitions, trained_tokenizer, tmp_path / "third", datasets=("realnews:0.333",), dev_fraction=0.0)
    full_rows = {tuple(r) for r in all_rows(tmp_path / "full", "train")}
    third_rows = [tuple(r) for r in all_rows(tmp_path / "third", "train")]
    assert set(third_rows) <= full_rows
    n = full["datasets"]["realnews"]["sequences"]
    assert third["datasets"]["realnews"]["sampling_ratio"] == 0.333
    assert 0.15 * n < len(third_rows) < 0.5 * n
    assert third["datasets"]["realnews"]["sequences_sampled_out"] == n - len(third_rows)


@pytest.mark.parametrize("ratio", ["1.5", "0", "-0.5"])
def test_sampling_ratios_outside_zero_to_one_are_refused(partitions, ratio):
    with pytest.raises(BuildError, match=rf"sampling ratio must be in \(0, 1\], got {float(ratio)}"):
        parse_dataset(f"{partitions / 'wiki'}:{ratio}")


def test_a_ratio_that_is_not_a_number_is_named_as_such_and_a_colon_in_a_folder_name_still_works(partitions,
                                                                                                  tmp_path):
    with pytest.raises(BuildError, match=rf"wiki:abc: 'abc' is not a sampling ratio \(a number in \(0, 1\], e.g. "
                                         rf"{partitions / 'wiki'}:0.333\)"):
        parse_dataset(f"{partitions / 'wiki'}:abc")
    (tmp_path / "wiki:v2").mkdir()
    assert parse_dataset(str(tmp_path / "wiki:v2")).folder == tmp_path / "wiki:v2"


@pytest.mark.parametrize("changed, key, before, after", [
    ({"seq_len": 32}, "max_seq_len", 16, 32), ({"seed": 1}, "seed", 0, 1), ({"dev_fraction": 0.2}, "dev_fraction",
                                                                            0.1, 0.2),
    ({"shard_size": 9}, "shard_size", 8, 9), ({"dev_run": 2}, "dev_run", 1, 2),
])
def test_resuming_a_build_with_other_settings_is_refused_naming_the_setting(partitions, trained_tokenizer, tmp_path,
                                                                            changed, key, before, after):
    # Another seed or fraction would mix two different splits in one folder: dev rows could also be in train.
    settings = dict(seq_len=16, seed=0, dev_fraction=0.1, shard_size=8, dev_run=1)
    build(partitions, trained_tokenizer, tmp_path, datasets=("wiki",), **settings)
    with pytest.raises(BuildError, match=rf"other settings \({key}: {before} there, {after} now\)"):
        build(partitions, trained_tokenizer, tmp_path, datasets=("wiki",), **{**settings, **changed})


def test_each_partition_file_draws_its_own_split_not_the_same_pattern_in_every_file(partitions, trained_tokenizer,
                                                                                     tmp_path):
    # Seeded by (seed, dataset, file): two datasets holding the same text split it differently.
    for name in ("copy1", "copy2"):
        shutil.copytree(partitions / "wiki", tmp_path / name)
    build(tmp_path, trained_tokenizer, tmp_path / "out", seq_len=16, datasets=("copy1", "copy2"),
          dev_fraction=0.5, dev_run=1, shard_size=100000)
    first, second = ([np.load(p).tolist() for p in sorted((tmp_path / "out").glob(f"{name}--*-dev-*.npy"))]
                     for name in ("copy1", "copy2"))
    assert first != second


@pytest.mark.parametrize("victim, other", [("books1/part-00000.txt", "books[12]/part-00000.txt"),
                                           ("books/part-00000-b.txt", "books/part-00000.txt"),
                                           ("enwiki/part-00000.txt", "wiki/part-00000.txt")],
                         ids=["folder-name-with-brackets", "partition-name-prefix", "dataset-name-suffix"])
def test_encoding_a_partition_file_deletes_only_its_own_old_shards(partitions, trained_tokenizer, tmp_path, victim,
                                                                   other):
    # Read as glob patterns, "books[12]--part-00000-*.npy" matches books1's shards and "books--part-00000-*.npy"
    # those of part-00000-b: encoding the one deleted the shards of the other, encoded before it.
    text = partition_files(partitions / "stories")[0].read_text()
    for root, files in (("alone", [victim]), ("both", [victim, other])):
        for name in files:
            (tmp_path / root / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / root / name).write_text(text)
    build(tmp_path / "alone", trained_tokenizer, tmp_path / "alone-shards", datasets=(victim.split("/")[0],))
    build(tmp_path / "both", trained_tokenizer, tmp_path / "both-shards",
          datasets=tuple(dict.fromkeys(name.split("/")[0] for name in (victim, other))))
    own = sorted(p.name for p in (tmp_path / "alone-shards").glob("*.npy"))
    assert own
    for name in own:
        assert np.array_equal(np.load(tmp_path / "alone-shards" / name), np.load(tmp_path / "both-shards" / name))


def test_a_finished_partition_whose_shard_was_deleted_is_encoded_again_not_a_crash(partitions, trained_tokenizer,
                                                                                   tmp_path, caplog):
    build(partitions, trained_tokenizer, tmp_path, datasets=("stories",))
    clean = {split: all_rows(tmp_path, split) for split in ("train", "dev")}
    shard = json.loads((tmp_path / "manifest" / "stories--part-00001.json").read_text())["shards"]["train"][0]
    (tmp_path / shard).unlink()
    with caplog.at_level("WARNING", logger="nystromformer.data"):
        build(partitions, trained_tokenizer, tmp_path, datasets=("stories",))
    assert f"stories--part-00001.json lists 1 shard(s) that do not exist (e.g. {shard})" in caplog.text
    for split in ("train", "dev"):
        assert np.array_equal(all_rows(tmp_path, split), clean[split])


def test_rerunning_a_finished_build_touches_no_file(partitions, trained_tokenizer, tmp_path):
    build(partitions, trained_tokenizer, tmp_path)
    before = file_states(tmp_path)
    build(partitions, trained_tokenizer, tmp_path)
    assert file_states(tmp_path) == before


class Interrupt(Exception):
    pass


def test_an_interrupted_build_resumes_to_the_same_arrays_as_an_uninterrupted_one(partitions, trained_tokenizer,
                                                                                 tmp_path):
    build(partitions, trained_tokenizer, tmp_path / "clean")
    done = []

    def stop_after_three(task):
        done.append(task)
        if len(done) == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        build(partitions, trained_tokenizer, tmp_path / "resumed", on_partition_done=stop_after_three)
    assert not (tmp_path / "resumed" / "train.json").exists()
    finished = {p: s for p, s in file_states(tmp_path / "resumed").items() if str(p).startswith("wiki--part-00000")}
    # Also lose one finished partition's manifest entry, as if the run died between its shards and its entry.
    (tmp_path / "resumed" / "manifest" / "wiki--part-00001.json").unlink()
    # and a hard kill while writing one of its shards leaves the shard's temporary (up to ~128 MB at 4096)
    (tmp_path / "resumed" / ".wiki--part-00001-train-00000.npy.k3j9x_ab.tmp").write_bytes(b"half a shard")
    build(partitions, trained_tokenizer, tmp_path / "resumed")
    assert not list((tmp_path / "resumed").glob(".*.tmp"))
    for split in ("train", "dev"):
        assert np.array_equal(all_rows(tmp_path / "clean", split), all_rows(tmp_path / "resumed", split))
    after = file_states(tmp_path / "resumed")
    assert finished and all(after[p] == s for p, s in finished.items())  # finished work was not redone
    assert json.loads((tmp_path / "clean" / "stats.json").read_text()) == \
        json.loads((tmp_path / "resumed" / "stats.json").read_text())


def test_roberta_ids_from_the_build_match_the_tokenizer_called_directly(shared_dir, partitions, tmp_path):
    roberta = shared_dir / "tokenizers" / "roberta-base"
    build(partitions, roberta, tmp_path, seq_len=64, datasets=("wiki",), dev_fraction=0.0, shard_size=1000)
    tok = load_tokenizer(roberta)
    from nystromformer.data.partitions import partition_files, read_partition
    expected = []
    for path in partition_files(partitions / "wiki"):
        stream = []
        for i, doc in enumerate(read_partition(path)):
            stream += ([tok.eos_token_id] if i else []) + tok(doc, add_special_tokens=False).input_ids
        expected += stream[: len(stream) // 62 * 62]
    assert all_rows(tmp_path, "train")[:, 1:-1].reshape(-1).tolist() == expected


@pytest.mark.parametrize("name", ["nystromformer-tests/no-such-tokenizer", "tokenizers/roberta-bse"])
def test_a_tokenizer_name_with_no_files_anywhere_is_an_error_not_an_empty_tokenizer(name, monkeypatch):
    # Offline, transformers 5 "loads" a hub-shaped name it has no files for as a tokenizer of 5 special tokens:
    # every text would encode to nothing (0 shards, or GLUE on empty inputs).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TokenizerError, match=rf"tokenizer '{name}' is neither a folder nor in the local Hugging "
                                             rf"Face cache"):
        load_tokenizer(name)


def test_a_tokenizer_path_that_is_not_a_folder_is_named_as_such_not_looked_up_on_the_hub(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    for given, says in ((tmp_path / "missing", "no such folder"), ("./missing-tok", "no such folder"),
                        (tmp_path / "vocab.json", "not a folder")):
        with pytest.raises(TokenizerError) as err:
            load_tokenizer(given)
        assert str(err.value) == f"tokenizer '{given}': {says}"


def test_a_failed_build_writes_nothing_so_the_corrected_command_runs(partitions, trained_tokenizer, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="stoies"):
        build(partitions, trained_tokenizer, out, datasets=("wiki", "stoies"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="empty"):
        build(partitions, tmp_path / "empty", out, datasets=("wiki", "stories"))
    assert not out.exists()
    stats = build(partitions, trained_tokenizer, out, datasets=("wiki", "stories"))
    assert set(stats["datasets"]) == {"wiki", "stories"}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_build_failing_on_its_first_partition_leaves_nothing_so_a_corrected_command_with_other_settings_runs(
        partitions, trained_tokenizer, tmp_path, workers):
    # meta.json used to be written before any partition was read: the folder, holding no shard, then refused the
    # corrected command's settings as those of "a folder built with other settings".
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "part-00000.txt").write_bytes(b"a caf\xe9 document\n")
    for name in ("stories", "wiki"):
        shutil.copytree(partitions / name, tmp_path / name)
    out = tmp_path / "out"
    # (With workers, the bad partition alone: the others, encoded at the same time, could write shards first.)
    failing = ("latin1", "stories") if workers == 1 else ("latin1",)
    with pytest.raises(PartitionError, match=r"latin1/part-00000.txt:1: not UTF-8"):
        build(tmp_path, trained_tokenizer, out, datasets=failing, workers=workers)
    assert not out.exists()
    stats = build(tmp_path, trained_tokenizer, out, datasets=("stories", "wiki"), seq_len=16, workers=workers)
    assert set(stats["datasets"]) == {"stories", "wiki"} and stats["train_sequences"]
    assert json.loads((out / "meta.json").read_text())["max_seq_len"] == 16


def stories_and_a_file_that_is_not_utf8(partitions, tmp_path):
    """Partition folders stories/ (fine) and latin1/ (its one file fails) under tmp_path; the output folder."""
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "part-00000.txt").write_bytes(b"a caf\xe9 document\n")
    shutil.copytree(partitions / "stories", tmp_path / "stories")
    return tmp_path / "out"


def test_a_build_failing_after_some_files_finished_says_they_are_kept_and_the_same_command_resumes(
        partitions, trained_tokenizer, tmp_path):
    out = stories_and_a_file_that_is_not_utf8(partitions, tmp_path)
    with pytest.raises(PartitionError) as err:
        build(tmp_path, trained_tokenizer, out, datasets=("stories", "latin1"))
    assert "latin1/part-00000.txt:1: not UTF-8" in str(err.value)
    assert f"{out} keeps the partition files finished so far" in str(err.value)
    finished = file_states(out)
    (tmp_path / "latin1" / "part-00000.txt").write_text("a café document\n")
    stats = build(tmp_path, trained_tokenizer, out, datasets=("stories", "latin1"))
    assert set(stats["datasets"]) == {"stories", "latin1"}
    # the stories shards, their manifest entry and meta.json were neither rewritten nor re-encoded
    assert len(finished) > 2 and all(file_states(out)[path] == state for path, state in finished.items())


def test_a_build_failing_after_its_first_shard_leaves_that_shard_with_its_meta_json(partitions, trained_tokenizer,
                                                                                     tmp_path, monkeypatch):
    # meta.json comes with the first file written, a shard included: a folder never holds shards without it
    from nystromformer.data.tokenize import DocumentEncoder
    encode_partition = DocumentEncoder.encode_partition

    def shards_then_a_bad_id(self, path):
        for _ in range(20):  # enough tokens for a bulk cut (64 blocks), so shards are written before the error
            yield from encode_partition(self, path)
        yield np.array([400])

    monkeypatch.setattr(DocumentEncoder, "encode_partition", shards_then_a_bad_id)
    out = tmp_path / "out"
    with pytest.raises(BuildError, match="encodes to token id 400"):
        build(partitions, trained_tokenizer, out, seq_len=16, datasets=("stories",), shard_size=1)
    assert list(out.glob("*.npy")) and not (out / "manifest").exists()
    assert json.loads((out / "meta.json").read_text())["max_seq_len"] == 16


def test_a_manifest_entry_comes_with_meta_json_even_for_a_partition_too_short_for_a_shard(
        partitions, trained_tokenizer, tmp_path):
    # The first partition gives no sequence at seq_len 4096 but is finished (its manifest entry); the second fails.
    # Without meta.json a corrected command with another seq_len would take the entry as finished at its settings.
    out = stories_and_a_file_that_is_not_utf8(partitions, tmp_path)
    with pytest.raises(PartitionError, match="not UTF-8"):
        build(tmp_path, trained_tokenizer, out, seq_len=4096, datasets=("stories", "latin1"))
    assert list((out / "manifest").glob("*.json")) and not list(out.glob("*.npy"))
    assert json.loads((out / "meta.json").read_text())["max_seq_len"] == 4096
    with pytest.raises(BuildError, match="built with other settings"):
        build(tmp_path, trained_tokenizer, out, seq_len=16, datasets=("stories", "latin1"))


def test_a_stale_temporary_meta_json_of_a_stopped_worker_is_removed(partitions, trained_tokenizer, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stale = out / ".meta.json.k3j2h1.tmp"
    stale.write_text('{"format": ')
    build(partitions, trained_tokenizer, out, datasets=("stories",))
    assert not stale.exists() and (out / "meta.json").is_file()


def test_the_split_indexes_follow_the_partition_files_when_a_rebuild_finds_fewer(partitions, trained_tokenizer,
                                                                                 tmp_path):
    shutil.copytree(partitions / "stories", tmp_path / "stories")
    (tmp_path / "stories" / "stats.json").unlink(missing_ok=True)  # (it would list the removed file)
    build(tmp_path, trained_tokenizer, tmp_path / "out", datasets=("stories",))
    partition_files(tmp_path / "stories")[-1].unlink()
    build(tmp_path, trained_tokenizer, tmp_path / "out", datasets=("stories",))
    build(tmp_path, trained_tokenizer, tmp_path / "fresh", datasets=("stories",))
    for split in ("train", "dev"):
        assert (json.loads((tmp_path / "out" / f"{split}.json").read_text())
                == json.loads((tmp_path / "fresh" / f"{split}.json").read_text()))


def test_a_resume_accepts_any_spelling_of_the_same_tokenizer_folder(partitions, trained_tokenizer, tmp_path,
                                                                   monkeypatch):
    out = tmp_path / "out"
    build(partitions, trained_tokenizer, out, datasets=("stories",))
    before = file_states(out)
    copy = tmp_path / "copied-tokenizer"
    shutil.copytree(trained_tokenizer, copy)
    monkeypatch.chdir(trained_tokenizer.parent)
    for spelling in (f"{trained_tokenizer}/", trained_tokenizer.name, f"./{trained_tokenizer.name}/", copy):
        build(partitions, spelling, out, datasets=("stories",))
    # meta.json of older builds holds the path as it was typed, relative to where the build ran.
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "tokenizer": trained_tokenizer.name}))
    before[Path("meta.json")] = file_states(out)[Path("meta.json")]
    build(partitions, trained_tokenizer, out, datasets=("stories",))
    assert file_states(out) == before


def test_a_resume_after_the_tokenizer_folders_files_changed_is_refused(partitions, trained_tokenizer, tmp_path):
    # train-tokenizer --overwrite into the same folder: the path is the same, the ids are not; resuming would mix
    # two tokenizations in one folder (and a finished folder would pass as up to date)
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(trained_tokenizer, tokenizer)
    out = tmp_path / "out"
    build(partitions, tokenizer, out, datasets=("stories",))
    assert json.loads((out / "meta.json").read_text())["tokenizer_files_sha256"]
    merges = (tokenizer / "merges.txt").read_text().splitlines()
    (tokenizer / "merges.txt").write_text("\n".join(merges[:1] + merges[2:3] + merges[1:2] + merges[3:]) + "\n")
    before = file_states(out)
    with pytest.raises(BuildError, match=rf"built with other settings \(the files of tokenizer {tokenizer} "
                                         rf"changed since its shards were encoded\); build into a new"):
        build(partitions, tokenizer, out, datasets=("stories",))
    assert file_states(out) == before
    # a folder built before the digest was recorded resumes as before (its tokenizer path is all it has)
    meta = json.loads((out / "meta.json").read_text())
    del meta["tokenizer_files_sha256"]
    (out / "meta.json").write_text(json.dumps(meta))
    build(partitions, tokenizer, out, datasets=("stories",))


@pytest.mark.parametrize("bad_id", [400, 65536 + 5, -1], ids=["vocab-size", "wraps-to-5-in-uint16", "negative"])
def test_a_token_id_outside_the_vocabulary_is_an_error_naming_it_not_wrapped_into_the_shard_dtype(
        partitions, trained_tokenizer, tmp_path, monkeypatch, bad_id):
    # A tokenizer whose ids pass its length (len(tokenizer) is the vocab_size the model gets) would index past the
    # embedding table; cast to uint16 first, 65,541 became 5, a valid id for another token.
    from nystromformer.data.tokenize import DocumentEncoder
    encode = DocumentEncoder.encode
    monkeypatch.setattr(DocumentEncoder, "encode", lambda self, docs: [np.insert(ids, 0, bad_id)
                                                                       for ids in encode(self, docs)])
    with pytest.raises(BuildError, match=rf"stories/part-00000.txt: document 1 encodes to token id {bad_id}, not "
                                         rf"in \[0, 400\)"):
        build(partitions, trained_tokenizer, tmp_path, datasets=("stories",))


def test_a_dataset_contributing_no_sequences_is_warned_about_and_recorded(partitions, trained_tokenizer, tmp_path,
                                                                       caplog):
    with caplog.at_level("WARNING", logger="nystromformer.data"):
        stats = build(partitions, trained_tokenizer, tmp_path, datasets=("wiki", "stories:0.0001"), dev_fraction=0.0)
    assert stats["datasets"]["stories"]["sequences"] > 0 and stats["datasets"]["wiki"]["train_sequences"] > 0
    assert stats["datasets"]["stories"]["train_sequences"] + stats["datasets"]["stories"]["dev_sequences"] == 0
    [warning] = stats["warnings"]
    assert warning.startswith("dataset stories (") and "sampled out at ratio 0.0001" in warning
    assert warning in caplog.text
    assert json.loads((tmp_path / "stats.json").read_text())["warnings"] == [warning]


# --- A preprocess swapping a partition folder in while build-shards reads it ---------------------------------------

def wiki_documents_of_fixture():
    return list(READERS["wiki"](expand_inputs([FIXTURES / "wiki"], INPUT_PATTERNS["wiki"]), SkipLog()))


def write_wiki(folder, documents):
    write_partitions(documents, folder, "wiki", SkipLog(), words_per_partition=150, min_words=0)


@pytest.mark.parametrize("when", ["while-encoding-a-file", "between-files", "after-the-last-file"])
def test_a_partition_folder_swapped_in_during_a_build_is_an_error_and_the_rerun_builds_the_new_folder(
        trained_tokenizer, tmp_path, monkeypatch, when):
    old, new = wiki_documents_of_fixture(), wiki_documents_of_fixture()[::-1]
    write_wiki(tmp_path / "clean" / "wiki", new)
    build(tmp_path / "clean", trained_tokenizer, tmp_path / "clean-shards", datasets=("wiki",))
    parts = tmp_path / "parts" / "wiki"
    write_wiki(parts, old)
    count = len(list(parts.glob("part-*.txt")))
    assert count >= 3
    swapped = []

    def swap():  # what a concurrent `preprocess` with new input does: a whole-folder swap
        if not swapped:
            write_wiki(parts, new)
            swapped.append(True)

    if when == "while-encoding-a-file":  # part-00001's old bytes are read, the swap comes before it is recorded
        from nystromformer.data.tokenize import DocumentEncoder
        encode = DocumentEncoder.encode_partition

        def encode_then_swap(self, path):
            for i, ids in enumerate(encode(self, path)):
                yield ids
                if path.name == "part-00001.txt":
                    swap()
        monkeypatch.setattr(DocumentEncoder, "encode_partition", encode_then_swap)
        changed, done = "part-00001.txt", None
    else:
        changed = "part-00001.txt" if when == "between-files" else "part-00000.txt"
        done = lambda task: swap() if task.source.name == ("part-00000.txt" if when == "between-files" else
                                                           f"part-{count - 1:05d}.txt") else None
    out = tmp_path / "shards"
    with pytest.raises(BuildError, match=rf"{changed}: the partition folder changed while building.*rerun build-"):
        build(tmp_path / "parts", trained_tokenizer, out, datasets=("wiki",), on_partition_done=done)
    assert swapped and not (out / "train.json").exists()
    assert not (out / "manifest" / f"wiki--{changed[:-4]}.json").exists() or when == "after-the-last-file"
    monkeypatch.undo()
    stats = build(tmp_path / "parts", trained_tokenizer, out, datasets=("wiki",))
    # No shard of the old folder stays: the result is that of a build of the new folder alone.
    for split in ("train", "dev"):
        assert np.array_equal(all_rows(tmp_path / "clean-shards", split), all_rows(out, split))
    clean = json.loads((tmp_path / "clean-shards" / "stats.json").read_text())
    assert stats["datasets"]["wiki"].pop("folder") == str(tmp_path / "parts" / "wiki")
    clean["datasets"]["wiki"].pop("folder")
    assert stats == clean and stats["datasets"]["wiki"]["documents"] == len(new)


def test_a_build_refuses_indexes_for_a_folder_whose_partitions_changed_after_they_were_encoded(
        trained_tokenizer, tmp_path):
    parts = tmp_path / "parts" / "wiki"
    write_wiki(parts, wiki_documents_of_fixture())
    last = sorted(parts.glob("part-*.txt"))[-1]

    def remove_the_last_partition(task):  # as a preprocess run writing fewer partitions would
        if task.source == last:
            write_wiki(parts, wiki_documents_of_fixture()[:2])
    with pytest.raises(BuildError, match=r"wiki: the partition folder changed while building"):
        build(tmp_path / "parts", trained_tokenizer, tmp_path / "shards", datasets=("wiki",),
              on_partition_done=remove_the_last_partition)
    assert not (tmp_path / "shards" / "train.json").exists()


def test_a_dev_split_far_from_its_fraction_is_warned_about_with_the_run_length_to_use(partitions, trained_tokenizer,
                                                                                      tmp_path, caplog):
    # Whole runs of --dev-run × 510 tokens go to dev: with less text than one run per partition file, each file
    # goes one way, and a handful of files cannot make 10%.
    with caplog.at_level("WARNING", logger="nystromformer.data"):
        stats = build(partitions, trained_tokenizer, tmp_path / "runs", datasets=("wiki", "stories"), seq_len=16)
    total = stats["train_sequences"] + stats["dev_sequences"]
    [warning] = stats["warnings"]
    assert f"the dev split holds {stats['dev_sequences']} of {total} sequences" in warning
    assert "whole runs of --dev-run 8192 × 510 tokens of text (8192 sequences of 512; ~1 in this build)" in warning
    assert warning in caplog.text
    # This fixture is too small for any run length (~5 runs of 510 tokens), and the warning says so.
    assert warning.endswith("too little text for a dev split at 16 tokens (runs must hold a few sequences, "
                            "--dev-run 1 or more, and it holds ~5 of those)")
    # Enough text for ~200 runs of 32 × 510 tokens: that run length is suggested; make's users set DEV_RUN, and
    # the folder keeps the settings it was built with.
    assert dev_split_warning(train=9000, dev=0, across=0, dev_fraction=0.1, dev_run=8192, seq_len=512).endswith(
        "build again with --dev-run 32 (make: DEV_RUN=32), into a new folder or after deleting this one (a folder "
        "keeps the settings it was built with)")
    # The same text in sequences of 4096: runs must hold a few of them (64 × 510 tokens), fewer runs then.
    assert ("build again with --dev-run 64 (still only ~140 runs: expect a rough fraction) (make: DEV_RUN=64)"
            in dev_split_warning(train=1122, dev=0, across=0, dev_fraction=0.1, dev_run=8192, seq_len=4096))
    # Runs too short for the sequences: many fall across a dev/train boundary, and the warning says so.
    assert dev_split_warning(train=900, dev=100, across=300, dev_fraction=0.1, dev_run=8, seq_len=4096).startswith(
        "300 of 1300 sequences (23%) lie across a boundary between a dev and a train run, in neither split")
    assert dev_split_warning(train=900, dev=100, across=0, dev_fraction=0.1, dev_run=8192, seq_len=512) is None


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:200]), "not a readable .npy shard"),
    (lambda p: np.save(p, np.array(["text"], dtype=object), allow_pickle=True), "not a readable .npy shard"),
    (lambda p: np.save(p, np.load(p).astype(np.float32) + 0.5), "dtype float32, but .*meta.json says uint16"),
])
def test_a_damaged_shard_is_an_error_naming_it_not_a_traceback_or_training_on_it(tmp_path, damage, message):
    from helpers import write_synthetic_data
    from nystromformer.shards import ShardError
    data = write_synthetic_data(tmp_path / "data")
    damage(data / "train-00001.npy")
    with pytest.raises(ShardError, match=f"train-00001.npy: {message}"):
        ShardedSequences(data, "train")


@pytest.mark.parametrize("bad_id", [300, 64], ids=["far-past", "equal-to-vocab-size"])
def test_a_token_id_past_the_vocabulary_is_an_error_naming_the_shard(tmp_path, bad_id):
    from helpers import write_synthetic_data
    from nystromformer.shards import ShardError
    data = write_synthetic_data(tmp_path / "data", vocab_size=64)
    rows = np.load(data / "dev-00000.npy")
    rows[3, 5] = bad_id  # (64: the first id past an embedding table of 64 rows)
    np.save(data / "dev-00000.npy", rows)
    dev = ShardedSequences(data, "dev")
    assert dev.rows([0, 1]).shape == (2, 32) and dev.rows([0, 1, 2]).max() < 64
    with pytest.raises(ShardError, match=rf"dev-00000.npy: token id {bad_id} is not below vocab_size 64"):
        dev.rows([2, 3])


@pytest.mark.parametrize("options, message", [
    ({"seed": -1}, r"--seed must be in \[0, 2\^63\), got -1"),
    ({"workers": 0}, "--workers must be at least 1, got 0"),
    ({"dev_fraction": 1.0}, r"--dev-fraction must be in \[0, 1\), got 1.0"),
    ({"dev_fraction": -0.1}, r"--dev-fraction must be in \[0, 1\), got -0.1"),
])
def test_impossible_build_options_are_refused_before_anything_is_written(partitions, trained_tokenizer, tmp_path,
                                                                         options, message):
    with pytest.raises(BuildError, match=message):
        build_shards([parse_dataset(str(partitions / "wiki"))], tmp_path / "out", str(trained_tokenizer),
                     seq_len=64, **options)
    assert not (tmp_path / "out").exists()


def test_shards_cannot_be_written_into_their_input_partition_folder(partitions, trained_tokenizer, tmp_path):
    copy = tmp_path / "wiki"
    shutil.copytree(partitions / "wiki", copy)
    before = sorted(p.name for p in copy.iterdir())
    for output in (copy, copy / "shards"):
        with pytest.raises(BuildError, match=f"--output {output}: is inside the input folder"):
            build_shards([parse_dataset(str(copy))], output, str(trained_tokenizer), seq_len=64)
    assert sorted(p.name for p in copy.iterdir()) == before


def parsed(command, *argv):
    import argparse

    from nystromformer.data import commands
    parser = argparse.ArgumentParser()
    commands.add_commands(parser.add_subparsers(dest="command", required=True))
    return vars(parser.parse_args([command, *map(str, argv)]))


def test_the_commands_defaults_are_those_of_the_functions_they_call():
    import inspect
    for command, function, argv in (("build-shards", build_shards, ["p", "--output", "o"]),
                                    ("train-tokenizer", train_tokenizer, ["--input", "p", "--output", "o"])):
        args = parsed(command, *argv)
        defaults = {name: p.default for name, p in inspect.signature(function).parameters.items()
                    if p.default is not inspect.Parameter.empty and name in args and name != "workers"}
        # (--workers defaults to the machine's cores; a library call to one process)
        assert defaults and all(args[name] == value for name, value in defaults.items()), (command, defaults)
    assert parsed("build-shards", "p", "--output", "o")["dev_run"] == 8192  # the paper's files of sequences


def test_every_build_shards_flag_reaches_the_build(partitions, trained_tokenizer, tmp_path):
    from test_data_readers import run_command
    out = tmp_path / "shards"
    assert run_command(["build-shards", partitions / "wiki", "--output", out, "--tokenizer", trained_tokenizer,
                        "--seq-len", 24, "--shard-size", 7, "--dev-fraction", 0.3, "--dev-run", 3, "--seed", 5,
                        "--workers", 1]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["max_seq_len"], meta["shard_size"], meta["dev_fraction"], meta["dev_run"], meta["seed"]) == \
        (24, 7, 0.3, 3, 5)


def test_a_model_folder_finds_its_tokenizer_beside_it_or_beside_its_data_whatever_the_working_folder(
        tmp_path, monkeypatch):
    from helpers import tiny_config, write_model_dir, write_synthetic_data
    from nystromformer.config import ConfigError, load_config
    from nystromformer.tokenizer import model_tokenizer
    data = write_synthetic_data(tmp_path / "data")
    (data / "tok").mkdir()
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "tokenizer": "tok"}))  # relative to the data folder
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "tok").mkdir(parents=True)  # a same-named folder in the working folder is not it
    monkeypatch.chdir(elsewhere)
    folder = write_model_dir(tmp_path / "run", tiny_config())
    assert Path(model_tokenizer(load_config(folder))).resolve() == data / "tok"
    config = {**tiny_config(), "tokenizer": "../tok-of-the-model"}  # config.json's: relative to the model folder
    assert Path(model_tokenizer(load_config(write_model_dir(tmp_path / "run2", config)))).resolve() == \
        tmp_path / "tok-of-the-model"
    del meta["tokenizer"]
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"run/config.json: no \"tokenizer\" key, and the data folder's meta.json"):
        model_tokenizer(load_config(folder))


def test_data_built_with_a_hub_name_not_in_this_machines_cache_says_to_set_the_config_key(tmp_path):
    # data built with --tokenizer roberta-base on a machine that had it cached, used where it is not (a container)
    from helpers import tiny_config, write_model_dir, write_synthetic_data
    from nystromformer.config import load_config
    from nystromformer.tokenizer import load_model_tokenizer
    write_synthetic_data(tmp_path / "data")  # meta.json's tokenizer: "synthetic", a name, not a folder
    folder = write_model_dir(tmp_path / "run", tiny_config())
    with pytest.raises(TokenizerError) as raised:
        load_model_tokenizer(load_config(folder))
    message = str(raised.value)
    assert message.startswith(f"the tokenizer named in {folder / '..' / 'data' / 'meta.json'}: tokenizer "
                              f"'synthetic' is neither a folder nor in the local Hugging Face cache")
    assert message.endswith(f"Or set \"tokenizer\" in {folder / 'config.json'} to a folder holding its files "
                            f"(relative to the model folder; in a container, a folder it mounts).")
    # config.json's own key names a folder: its error is about that folder, with no hint to set the key
    write_model_dir(folder, {**tiny_config(), "tokenizer": "tok"})
    with pytest.raises(TokenizerError, match=r"config.json: tokenizer: tokenizer '.*/run/tok': no such folder$"):
        load_model_tokenizer(load_config(folder))


def test_a_repository_mounted_elsewhere_still_finds_the_tokenizer_its_data_was_built_with(
        partitions, trained_tokenizer, tmp_path):
    # As with docker run -v "$PWD:/workspace": meta.json's absolute path is the host's; from the data folder, the
    # tokenizer is where it was.
    from helpers import tiny_config, write_model_dir
    from nystromformer.config import ConfigError, load_config
    from nystromformer.tokenizer import model_tokenizer
    host = tmp_path / "host"
    shutil.copytree(trained_tokenizer, host / "tokenizers" / "tok")
    build(partitions, host / "tokenizers" / "tok", host / "data-preprocessing" / "32", datasets=("wiki",))
    config = {**tiny_config(), "data_folder": "../data-preprocessing/32"}
    config["model"]["vocab_size"] = 400
    write_model_dir(host / "model", config)
    meta = json.loads((host / "data-preprocessing" / "32" / "meta.json").read_text())
    assert meta["tokenizer_relative"] == "../../tokenizers/tok"
    mounted = host.rename(tmp_path / "workspace")
    assert Path(model_tokenizer(load_config(mounted / "model"))).resolve() == mounted / "tokenizers" / "tok"
    # A tokenizer outside what is mounted: say so, and which key to set.
    shutil.rmtree(mounted / "tokenizers")
    with pytest.raises(ConfigError, match=r"model/config.json: no \"tokenizer\" key, and the tokenizer folder the "
                                          r"data was built with .* is not here \(tried .*\): set \"tokenizer\""):
        model_tokenizer(load_config(mounted / "model"))


def test_a_tokenizer_without_a_mask_token_cannot_pretrain(trained_tokenizer):
    tokenizer = load_tokenizer(trained_tokenizer)
    tokenizer.mask_token = None
    with pytest.raises(TokenizerError, match="tokenizer has no mask token"):
        special_token_ids(tokenizer)
