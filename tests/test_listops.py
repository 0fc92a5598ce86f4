"""LRA ListOps: generator vs an independent evaluator, limits, the TSV loader, and a tiny learning run."""
import argparse
import csv
import inspect
import json
from pathlib import Path

import pytest
import torch

from nystromformer.cli import main
from nystromformer.config import ConfigError
from nystromformer.lra import listops
from nystromformer.lra.commands import add_train_arguments, run_train
from nystromformer.config import ATTENTION_TYPES
from nystromformer.lra.train import (RunSettings, encode_splits, majority_accuracy, model_config, padded_length,
                                     train_one)

FIXTURES = Path(__file__).parent / "fixtures" / "listops"


@pytest.mark.parametrize("source,value", [
    ("[MAX 4 3 [MIN 2 3 ] 1 0 ]", 4),
    ("[MIN 5 [MAX 6 7 ] 8 ]", 5),
    ("[SM 9 9 ]", 8),
    ("[MED 1 2 ]", 1),            # int(np.median([1, 2])) = int(1.5)
    ("[MED 3 9 1 ]", 3),
    ("[MED 2 9 4 8 ]", 6),        # (4 + 8) / 2
    ("[SM [SM 5 5 ] 7 ]", 7),
    ("( ( ( [SM 9 ) 9 ) ] )", 8),  # LRA's parenthesised form
    ("7", 7),
])
def test_evaluator_on_hand_written_expressions(source, value):
    assert listops.evaluate_expression(source) == value


@pytest.mark.parametrize("bad", ["[MAX 1 2", "[MAX ]", "[FOO 1 ]", "[MAX 1 ] 2", "12"])
def test_evaluator_rejects_malformed(bad):
    with pytest.raises(ValueError):
        listops.evaluate_expression(bad)


def test_generated_labels_agree_with_independent_evaluator_and_limits_hold():
    rows = listops.generate(400, seed=3, max_depth=6, max_args=10, min_length=20, max_length=300)
    assert len(rows) == 400 and len({s for s, _ in rows}) == 400
    for source, label in rows:
        tokens = source.split()
        assert 20 <= len(tokens) <= 300
        assert listops.expression_depth(source) <= 5  # LRA's depth counts the digit level: ops nest <= 5
        assert set(tokens) <= set(listops.VOCAB[2:])
        assert listops.evaluate_expression(source) == label
    assert len({lab for _, lab in rows}) == 10
    assert max(listops.expression_depth(s) for s, _ in rows) >= 4
    # Seeded: same seed, same data; another seed, other data.
    assert listops.generate(20, seed=3, max_depth=6, min_length=20, max_length=300) == rows[:20]
    assert listops.generate(20, seed=4, max_depth=6, min_length=20, max_length=300) != rows[:20]


def test_lra_scale_lengths_and_depth():
    # LRA's defaults: depth 10, 10 arguments, strictly between 500 and 2000 tokens
    defaults = {k: p.default for k, p in inspect.signature(listops.generate).parameters.items()}
    assert (defaults["max_depth"], defaults["max_args"], defaults["min_length"], defaults["max_length"]) == \
        (10, 10, 501, 1999)
    rows = listops.generate(5, seed=0)
    for source, label in rows:
        assert 501 <= len(source.split()) <= 1999 and listops.expression_depth(source) <= 9
        assert listops.evaluate_expression(source) == label


def test_splits_are_disjoint_and_tsv_round_trips(tmp_path):
    splits = listops.generate_splits({"train": 50, "dev": 10, "test": 10}, seed=0, max_depth=3, max_args=4,
                                     min_length=5, max_length=40)
    sources = [set(s for s, _ in rows) for rows in splits.values()]
    assert not (sources[0] & sources[1]) and not (sources[0] & sources[2]) and not (sources[1] & sources[2])
    for split, rows in splits.items():
        listops.write_tsv(tmp_path / listops.SPLIT_FILES[split], rows)
    with open(tmp_path / "basic_train.tsv") as f:
        assert next(csv.reader(f, delimiter="\t")) == ["Source", "Target"]
    loaded = listops.load_lra_dir(tmp_path)
    assert [(" ".join(t), lab) for t, lab in loaded["train"]] == splits["train"]


def test_loader_parses_lra_fixture_with_parentheses():
    data = listops.load_lra_dir(FIXTURES)
    assert [len(data[s]) for s in ("train", "dev", "test")] == [3, 1, 2]
    tokens, label = data["train"][0]
    assert tokens == "[MAX 4 3 [MIN 2 3 ] 1 0 ]".split() and label == 4
    for rows in data.values():
        for tokens, label in rows:
            assert "(" not in tokens and listops.evaluate_expression(" ".join(tokens)) == label
    ids = listops.encode(tokens, 5)
    assert len(ids) == 5 and listops.TOKEN_ID["<unk>"] not in ids


def test_loader_errors_are_clear(tmp_path):
    with pytest.raises(listops.ListOpsDataError, match="basic_train.tsv"):
        listops.load_lra_dir(tmp_path)
    (tmp_path / "x.tsv").write_text("a\tb\n1\t2\n")
    with pytest.raises(ValueError, match="Source"):
        listops.read_tsv(tmp_path / "x.tsv")


def test_an_empty_split_file_is_an_error_naming_it(tmp_path):
    for split, name in listops.SPLIT_FILES.items():
        listops.write_tsv(tmp_path / name, [] if split == "dev" else [("[SM 1 2 ]", 3)])
    with pytest.raises(listops.ListOpsDataError, match="basic_val.tsv: no rows after the header"):
        listops.load_lra_dir(tmp_path)


@pytest.mark.parametrize("flags, named", [
    (["--train-size", "0"], "--train-size: must be at least 1, got 0"),
    (["--test-size", "-1"], "--test-size: must be at least 1, got -1"),
    (["--max-depth", "1"], "--max-depth: must be at least 2"),
    (["--max-depth", "1200"], "--max-depth: at most 500 (LRA uses 10), got 1200"),
    (["--max-args", "1"], "--max-args: an operator takes 2 to --max-args arguments; must be at least 2, got 1"),
    (["--gen-max-length", "3", "--min-length", "2"], "--gen-max-length: the shortest expression has 4 tokens"),
    (["--min-length", "50", "--gen-max-length", "40"], "--min-length 50 is above --gen-max-length 40"),
    (["--max-depth", "2", "--max-args", "3", "--min-length", "6"],
     "--min-length: trees of --max-depth 2 with --max-args 3 have at most 5 tokens, got 6"),
])
@pytest.mark.parametrize("command", ["listops-generate", "listops-train"])
def test_generation_limits_no_tree_can_meet_are_one_error_line_not_minutes_of_drawing(tmp_path, capsys, command,
                                                                                      flags, named):
    small = ["--train-size", "4", "--dev-size", "2", "--test-size", "2", "--max-depth", "3", "--min-length", "5",
             "--gen-max-length", "40"]
    argv = [command, "--out", str(tmp_path / "out"), *small, *flags]
    if command == "listops-train":
        argv += ["--generate", "--attn-types", "softmax", "--steps", "2", "--warmup", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_deep_trees_far_longer_than_the_limit_are_abandoned_not_completed():
    # At depth 20 most trees run to tens of thousands of tokens and more: completing each took minutes in all.
    rows = listops.generate(10, seed=0, max_depth=20, max_args=10, min_length=10, max_length=60)
    assert len(rows) == 10 and all(10 <= len(src.split()) <= 60 for src, _ in rows)
    assert all(listops.evaluate_expression(src) == label for src, label in rows)


def test_at_lra_settings_no_tree_is_abandoned_so_the_data_is_that_of_full_generation(monkeypatch):
    # Abandoning a tree changes every later draw: at LRA's settings it must never happen (a full 100k-tree
    # generation, 303,925 draws, peaked at 7,024 tokens against the 127,936-token bound).
    abandoned = []
    draw = listops.generate_tree

    def counted(*args):
        try:
            return draw(*args)
        except listops._TooLong:
            abandoned.append(args[0])
            raise
    monkeypatch.setattr(listops, "generate_tree", counted)
    rows = listops.generate(1000, seed=0)
    assert len(rows) == 1000 and abandoned == []
    monkeypatch.setattr(listops, "GIVE_UP_FACTOR", 10 ** 9)
    assert listops.generate(1000, seed=0) == rows


@pytest.mark.parametrize("content, message", [
    ("Source\tTarget\n[MAX 1 2 ]\t2\n[MAXX 1 2 ]\t2\n", r"x.tsv:3: unknown token\(s\) '\[MAXX'"),
    ("Source\tTarget\n[MAX 1 2 ]\t2\textra\n", r"x.tsv:2: expected 2 tab-separated columns, got 3"),
    ("Source\tTarget\n[MAX 1 2 ]\t2\n[MAX 1 \udcff ]\t2\n", r"x.tsv:3: not UTF-8"),
    ("Source\tTarget\n[MAX 1 2 ]\t10\n", r"x.tsv:2: .*10"),
])
def test_a_listops_file_row_that_is_not_listops_is_an_error_naming_the_line(tmp_path, content, message):
    (tmp_path / "x.tsv").write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(listops.ListOpsDataError, match=message):
        listops.read_tsv(tmp_path / "x.tsv")


def test_the_longest_tree_bound_is_reached_by_the_generator():
    rows = listops.generate(20, seed=0, max_depth=2, max_args=3, min_length=5, max_length=5)
    assert {len(src.split()) for src, _ in rows} == {listops.longest_tree(2, 3)} == {5}
    assert listops.longest_tree(3, 10) == 122  # [OP + 10 × [OP + 10 digits + ] + ]


def test_lra_default_model_settings():
    s = RunSettings()
    assert (s.num_layers, s.dim, s.num_head, s.ffn_dim, s.batch_size, s.learning_rate, s.warmup, s.steps,
            s.eval_every, s.max_length) == (2, 64, 2, 128, 32, 1e-4, 1000, 5000, 50, 2000)
    cfg = model_config("nystrom", s)
    assert (cfg.num_landmarks, cfg.conv_kernel_size, cfg.head_dim, cfg.max_seq_len) == (64, 35, 32, 2000)
    assert cfg.pre_layer_norm and cfg.pad_token_id == listops.PAD_ID
    # --set wins over the LRA settings of the attention type
    cfg = model_config("nystrom", s, {"num_landmarks": 32, "conv_kernel_size": 3})
    assert (cfg.num_landmarks, cfg.conv_kernel_size) == (32, 3)
    # a shorter run shortens the defaults' sequence-sized settings, never a value given with --set
    short = RunSettings(max_length=100)
    assert model_config("linformer", short).linformer_k == 100
    with pytest.raises(ConfigError, match=r"model.linformer_k: must be <= max_seq_len \(100\), got 5000"):
        model_config("linformer", short, {"linformer_k": 5000})


def test_tiny_listops_run_beats_majority_class():
    raw = listops.generate_splits({"train": 2000, "dev": 300, "test": 300}, seed=0, max_depth=2, max_args=5,
                                  min_length=1, max_length=40)
    splits = encode_splits(raw, 64)
    majority = majority_accuracy(splits["train"], splits["test"])
    s = RunSettings(dim=32, num_head=2, ffn_dim=64, dropout=0.0, learning_rate=3e-3, warmup=30, steps=300,
                    eval_every=100, max_length=64)
    result = train_one("softmax", splits, s)
    assert majority < 0.2
    assert result["test_accuracy"] > majority + 0.25, (result, majority)


def test_train_command_writes_results_table(tmp_path):
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    args = p.parse_args(["--data", str(FIXTURES), "--out", str(tmp_path), "--attn-types", "linear,bigbird",
                         "--steps", "3", "--eval-every", "2", "--warmup", "1", "--max-length", "32",
                         "--dim", "16", "--ffn-dim", "16", "--set", "block_size=8"])
    assert run_train(args) == 0
    md = (tmp_path / "listops_results.md").read_text()
    assert "| linear |" in md and "| bigbird |" in md and "Majority-class" in md
    rows = list(csv.DictReader(open(tmp_path / "listops_results.csv")))
    assert [r["attn_type"] for r in rows] == ["linear", "bigbird"] and all(r["steps"] == "3" for r in rows)


def test_time_limit_stops_training_early_and_still_reports_a_test_accuracy():
    data = [(listops.encode("[MAX 1 2 ]".split(), 16), 2)] * 8
    splits = {"train": data, "dev": data, "test": data}
    lines = []
    s = RunSettings(dim=16, num_head=2, ffn_dim=16, batch_size=4, warmup=1, steps=100, eval_every=50, max_length=16,
                    time_limit_s=0.0)
    result = train_one("softmax", splits, s, log=lines.append)
    assert result["steps"] == 1 and result["best_step"] == 1 and 0.0 <= result["test_accuracy"] <= 1.0
    assert any('"stopped_early": true' in line and '"planned_steps": 100' in line for line in lines)


def test_seeds_run_each_type_once_per_seed_and_summarise(tmp_path):
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    args = p.parse_args(["--data", str(FIXTURES), "--out", str(tmp_path), "--attn-types", "softmax,linear",
                         "--seeds", "0,1", "--steps", "2", "--eval-every", "1", "--warmup", "1", "--max-length", "32",
                         "--dim", "16", "--ffn-dim", "16"])
    assert run_train(args) == 0
    rows = list(csv.DictReader(open(tmp_path / "listops_results.csv")))
    assert [(r["attn_type"], r["seed"]) for r in rows] == [("softmax", "0"), ("softmax", "1"), ("linear", "0"),
                                                          ("linear", "1")]
    md = (tmp_path / "listops_results.md").read_text()
    assert "Over seeds" in md and "| softmax | 2 |" in md and "| linear | 2 |" in md
    settings = json.loads(md.split("Settings: `")[1].split("`")[0])
    assert settings["seeds"] == [0, 1] and "seed" not in settings  # the seeds run, not --seed's default


@pytest.mark.parametrize("flags, named", [
    (["--seeds", "0,x"], "--seeds: expected comma-separated integers, got '0,x'"),
    (["--attn-types", "softmax,nystrm"], "--attn-types: unknown attention type(s) nystrm"),
    (["--attn-types", "softmax,linear,softmax"], "--attn-types: softmax given more than once"),
    (["--seeds", "3,1,3"], "--seeds: 3 given more than once"),  # one run twice: two "seeds" of spread 0
    (["--set", "num_landmarks=thirty"], "--set num_landmarks=thirty: the value must be JSON"),
    (["--set", "num_landmark=32"], "--set num_landmark=32: 'num_landmark' is not a model key"),
    (["--set", "model.foo=1"], "--set model.foo=1: 'foo' is not a model key"),
    (["--set", "num_landmarks=0"], "--set num_landmarks: must be >= 1, got 0 (the softmax run's model)"),
    (["--dropout", "2"], "--dropout: must be in [0, 1), got 2.0 (the softmax run's model)"),
    (["--dim", "15", "--num-head", "2"], "--dim / --num-head: num_head (2) x head_dim (7) = 14 must equal "
                                         "transformer_dim (15)"),
    (["--set", "num_landmarks=\"32\""], "num_landmarks"),
    (["--data", "no-such-folder"], "no-such-folder: missing basic_train.tsv"),
    (["--steps", "0"], "--steps: must be at least 1, got 0"),
    (["--eval-every", "0"], "--eval-every: must be at least 1, got 0"),
    (["--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup: must be at least 0, got -1"),
    (["--steps", "500"], "--warmup: 1000 warm-up steps are not fewer than --steps 500"),
    (["--steps", "1000"], "--warmup: 1000 warm-up steps are not fewer than --steps 1000"),
    (["--learning-rate", "0"], "--learning-rate: must be positive, got 0.0"),
    (["--eval-batches", "0"], "--eval-batches: must be positive, got 0"),
    (["--time-limit-s", "-5"], "--time-limit-s: must be at least 0, got -5.0"),
    (["--device", "gpu"], "--device gpu: not a device; use cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "--device cuda:99: "),
    (["--attn-types", " , "], "--attn-types: give at least one of softmax"),
    (["--set", 'attn_type="linformer"'], "--set attn_type: the attention is chosen by --attn-types"),
    (["--set", "max_seq_len=8"], "--set max_seq_len: set by --max-length"),
    (["--learning-rate", "inf"], "--learning-rate: must be positive, got inf"),
    (["--out", str(FIXTURES / "basic_train.tsv")], "is a file, not a folder"),
])
def test_user_mistakes_are_one_error_line_before_any_training(tmp_path, capsys, flags, named):
    argv = ["listops-train", "--data", str(FIXTURES), "--out", str(tmp_path / "out"), "--attn-types", "softmax"]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()

def test_every_operator_takes_two_to_max_args_arguments_and_no_tree_repeats_across_splits():
    # 4 operators x 10 x 10 digit pairs: 400 distinct trees, so 250 draws would repeat some without the check.
    splits = listops.generate_splits({"train": 150, "dev": 50, "test": 50}, seed=0, max_depth=2, max_args=2,
                                     min_length=4, max_length=4)
    sources = [src for rows in splits.values() for src, _ in rows]
    assert len(set(sources)) == len(sources) == 250
    for source, _ in listops.generate(200, seed=1, max_depth=4, max_args=5, min_length=1, max_length=200):
        counts = []  # arguments of each open operator
        for token in source.split():
            if token == listops.END:
                assert 2 <= counts.pop() <= 5, source
            else:
                if counts:
                    counts[-1] += 1
                if token.startswith("["):
                    counts.append(0)


def test_a_long_sequence_keeps_its_head_when_truncated_as_lra_does():
    assert listops.encode("[MAX 1 2 ]".split(), 2) == [listops.TOKEN_ID["[MAX"], listops.TOKEN_ID["1"]]


def test_expressions_longer_than_max_length_are_truncated_and_counted_per_split():
    raw = {"train": [("[MAX 1 2 ]", 2), ("[MIN 3 4 5 ]", 3), ("7", 7)], "test": [("[MAX 1 ]", 1)]}
    messages = []
    splits = encode_splits(raw, 4, log=messages.append)
    assert [len(ids) for ids, _ in splits["train"]] == [4, 4, 1] and [lab for _, lab in splits["train"]] == [2, 3, 7]
    assert messages == ["warning: --max-length 4: 1 of 3 train expressions are longer and were truncated"]


def tiny_splits():
    raw = listops.generate_splits({"train": 64, "dev": 16, "test": 16}, seed=0, max_depth=2, max_args=3,
                                  min_length=1, max_length=20)
    return encode_splits(raw, 24)


TINY = dict(dim=16, num_head=2, ffn_dim=16, batch_size=8, warmup=1, max_length=24)


def test_the_test_accuracy_is_that_of_the_best_dev_checkpoint_not_the_last(monkeypatch):
    from nystromformer.lra import train as lra_train
    splits, seen, dev_scores = tiny_splits(), [], [0.9, 0.1]  # step 2 is the best, step 4 (the last) worse
    real = lra_train.accuracy

    def accuracy(model, data, *args, **kwargs):
        seen.append(({k: t.clone() for k, t in model.state_dict().items()}, data is splits["dev"]))
        real(model, data, *args, **kwargs)
        return dev_scores.pop(0) if data is splits["dev"] else 0.5

    monkeypatch.setattr(lra_train, "accuracy", accuracy)
    result = train_one("softmax", splits, RunSettings(**TINY, steps=4, eval_every=2, learning_rate=1e-2))
    assert result["best_step"] == 2 and result["best_dev_accuracy"] == 0.9
    [(at_2, _), (at_4, _), (tested, is_dev)] = seen
    assert not is_dev and all(torch.equal(tested[k], t) for k, t in at_2.items())
    assert any(not torch.equal(at_4[k], t) for k, t in at_2.items())


def test_the_last_step_is_evaluated_when_steps_is_not_a_multiple_of_eval_every():
    lines = []
    train_one("softmax", tiny_splits(), RunSettings(**TINY, steps=3, eval_every=2), log=lines.append)
    assert [json.loads(line)["step"] for line in lines] == [2, 3]


def test_a_seed_fixes_the_whole_run_and_another_seed_gives_another():
    splits = tiny_splits()
    runs = [train_one("softmax", splits, RunSettings(**TINY, steps=4, eval_every=2, seed=seed)) for seed in (0, 0, 1)]
    timings = ("train_seconds", "eval_seconds")
    same = lambda a, b: {k: v for k, v in a.items() if k not in timings} == \
        {k: v for k, v in b.items() if k not in timings}  # noqa: E731
    assert same(runs[0], runs[1]) and not same(runs[0], runs[2])


# Small enough for a test, long enough that each type runs its approximation, not exact attention on a short input
SHORT_RUN_ATTENTION = {"nystrom": {"num_landmarks": 8}, "bigbird": {"block_size": 8}, "longformer": {"window_size": 8},
                       "linformer": {"linformer_k": 16}, "linformer_revisited": {"linformer_k": 16},
                       "performer": {"performer_num_features": 16}, "reformer": {"reformer_bucket_size": 8}}


@pytest.mark.parametrize("attn_type", ATTENTION_TYPES)
def test_a_rows_prediction_does_not_depend_on_its_batch_mates_or_the_batch_size(attn_type):
    # Scored alone, or beside a row three times longer, a row gets the same logits: the types whose outputs move with
    # the amount of padding (Nyström's landmarks, Reformer's buckets, BigBird's blocks) are padded to --max-length,
    # and Nyström's batch-wide pseudo-inverse scale is taken per row (before 2026-11-29, each padded to its batch's longest row, logits moved by 2e-3 to 5e-3 here, and by up to 3.6 at LRA lengths).
    from nystromformer.lra.train import ListOpsClassifier, accuracy
    torch.manual_seed(0)
    s = RunSettings(dim=16, num_head=2, ffn_dim=16, warmup=1, steps=2, max_length=96, dropout=0.0)
    model = ListOpsClassifier(model_config(attn_type, s, SHORT_RUN_ATTENTION.get(attn_type)), hidden=16)
    with torch.no_grad():  # larger weights than the init's, so that attention's differences reach the logits
        for p in model.parameters():
            p.mul_(4.0)
    short = listops.encode(("[MAX " + " ".join("[MIN 2 3 7 ]" for _ in range(6)) + " ]").split(), 96)
    long = listops.encode(("[SM " + " ".join("[MED 1 5 9 ]" for _ in range(18)) + " ]").split(), 96)
    assert len(short) == 32 and len(long) == 92  # several landmark segments, blocks and buckets either way
    pad_to = padded_length(attn_type, s)
    logits, groups = [], set()
    model.register_forward_hook(lambda module, inputs, output: logits.append(output[0]))
    # Nyström's batch-wide pseudo-inverse scale is taken per row while scoring (init_rows 1), over the batch after
    model.register_forward_pre_hook(lambda module, inputs: groups.update(
        m.init_rows for m in module.modules() if hasattr(m, "init_rows")))
    accuracy(model, [(short, 0)], 1, "cpu", pad_to=pad_to)
    accuracy(model, [(short, 0), (long, 0)], 2, "cpu", pad_to=pad_to)
    assert model.training  # accuracy() leaves the mode it found
    assert groups == ({1} if attn_type == "nystrom" else set())
    assert all(m.init_rows is None for m in model.modules() if hasattr(m, "init_rows"))
    assert logits[0].abs().max() > 0.1
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


def test_batches_pad_to_the_given_length_and_refuse_a_longer_row():
    from nystromformer.lra.train import batches
    rows = [([5, 6, 7], 1), ([5], 2)]
    [(ids, mask, y)] = batches(rows, 2, shuffle=False, pad_to=6)
    assert ids.tolist() == [[5, 6, 7] + [listops.PAD_ID] * 3, [5] + [listops.PAD_ID] * 5]
    assert mask.sum(1).tolist() == [3, 1] and y.tolist() == [1, 2]
    [(ids, _, _)] = batches(rows, 2, shuffle=False)
    assert ids.shape == (2, 3)
    with pytest.raises(ValueError, match="a row of 3 tokens does not fit the padded length 2"):
        next(batches(rows, 2, shuffle=False, pad_to=2))
    s = RunSettings(max_length=96)
    assert {t: padded_length(t, s) for t in ("nystrom", "reformer", "bigbird", "softmax", "linear")} == \
        {"nystrom": 96, "reformer": 96, "bigbird": 96, "softmax": None, "linear": None}


def test_majority_accuracy_takes_the_class_from_training_and_the_table_reports_the_sample_deviation(tmp_path):
    from nystromformer.lra.train import write_results
    train, test = [([1], 3)] * 3 + [([1], 4)], [([1], 4)] * 3 + [([1], 3)]
    assert majority_accuracy(train, test) == 0.25
    runs = [{"attn_type": "softmax", "seed": seed, "test_accuracy": acc, "best_dev_accuracy": acc, "best_step": 1,
             "steps": 1, "train_seconds": 0, "eval_seconds": 0, "padding": "to the longest row", "params": 1}
            for seed, acc in ((0, 0.5), (1, 0.7))]
    write_results(runs, tmp_path, "t", RunSettings(), 0.1)
    assert "| softmax | 2 | 60.00 ± 14.14 | 60.00 ± 14.14 |" in (tmp_path / "listops_results.md").read_text()


def test_eval_batches_reads_exactly_that_many_batches():
    from nystromformer.lra.train import ListOpsClassifier, accuracy
    model = ListOpsClassifier(model_config("softmax", RunSettings(**TINY, steps=2)), hidden=16)
    rows = [(listops.encode("[MAX 1 2 ]".split(), 24), 2)] * 20
    seen = []
    model.register_forward_hook(lambda module, inputs, output: seen.append(len(output)))
    accuracy(model, rows, 8, "cpu", max_batches=2)
    assert seen == [8, 8]


def test_held_out_splits_stay_the_same_trees_whatever_the_training_size():
    from nystromformer.lra.commands import add_gen_arguments, generate_from_args
    p = argparse.ArgumentParser()
    add_gen_arguments(p)
    small, large = (generate_from_args(p.parse_args(
        ["--out", "unused", "--train-size", size, "--dev-size", "10", "--test-size", "10", "--max-depth", "3",
         "--max-args", "4", "--min-length", "5", "--gen-max-length", "40"])) for size in ("50", "60"))
    assert small["test"] == large["test"] and small["dev"] == large["dev"]
    assert small["train"] == large["train"][:50]


def test_the_log_separates_calls_types_and_seeds(tmp_path):
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    flags = ["--data", str(FIXTURES), "--out", str(tmp_path), "--attn-types", "softmax,linear", "--seeds", "0,1",
             "--steps", "2", "--eval-every", "1", "--warmup", "1", "--max-length", "32", "--dim", "16",
             "--ffn-dim", "16"]
    assert run_train(p.parse_args(flags)) == 0
    assert run_train(p.parse_args(flags)) == 0  # a second call into the same folder appends
    records = [json.loads(line) for line in open(tmp_path / "listops_log.jsonl")]
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    assert len(starts) == 2 and records[0]["seeds"] == [0, 1] and records[0]["attn_types"] == ["softmax", "linear"]
    for call in (records[starts[0] + 1:starts[1]], records[starts[1] + 1:]):
        curves = {(r["attn_type"], r["seed"]): [] for r in call if "step" in r}
        for r in call:
            if "dev_accuracy" in r:
                curves[r["attn_type"], r["seed"]].append(r["step"])
        assert curves == {(t, seed): [1, 2] for t in ("softmax", "linear") for seed in (0, 1)}


def test_the_time_limit_striking_on_the_last_planned_step_is_not_an_early_stop():
    data = [(listops.encode("[MAX 1 2 ]".split(), 16), 2)] * 8
    lines = []
    s = RunSettings(dim=16, num_head=2, ffn_dim=16, batch_size=4, warmup=0, steps=1, eval_every=50, max_length=16,
                    time_limit_s=0.0)
    result = train_one("softmax", {"train": data, "dev": data, "test": data}, s, log=lines.append)
    assert result["steps"] == 1 and len(lines) == 1 and "stopped_early" not in lines[0]


def test_the_logged_loss_is_the_mean_since_the_last_evaluation(monkeypatch):
    from nystromformer.lra import train as lra_train
    losses = iter([4.0, 2.0, 3.0, 1.0])
    real = lra_train.F.cross_entropy

    def cross_entropy(*args, **kwargs):  # the real loss, shifted to the scripted value (its gradient unchanged)
        loss = real(*args, **kwargs)
        return loss - loss.detach() + next(losses)

    monkeypatch.setattr(lra_train.F, "cross_entropy", cross_entropy)
    lines = []
    train_one("softmax", tiny_splits(), RunSettings(**TINY, steps=4, eval_every=2), log=lines.append)
    assert [json.loads(line)["loss"] for line in lines] == [3.0, 2.0]


def test_accuracy_leaves_a_model_in_evaluation_mode_in_evaluation_mode():
    from nystromformer.lra.train import ListOpsClassifier, accuracy
    s = RunSettings(**TINY, steps=2)
    model = ListOpsClassifier(model_config("softmax", s), hidden=16).eval()
    accuracy(model, tiny_splits()["dev"], 4, "cpu")
    assert not model.training


@pytest.mark.parametrize("attn_type, pad_to", [("nystrom", 24), ("softmax", None)])
def test_dev_and_test_are_scored_padded_as_training_pads(monkeypatch, attn_type, pad_to):
    # Nyström's landmarks move with the amount of padding: scored padded to the batch's longest row, a model
    # trained on rows padded to --max-length would be evaluated on other inputs than it trained on
    from nystromformer.lra import train as lra_train
    real, seen = lra_train.accuracy, []

    def accuracy(model, data, batch_size, device, max_batches=None, pad_to=None):
        seen.append(pad_to)
        return real(model, data, batch_size, device, max_batches, pad_to)

    monkeypatch.setattr(lra_train, "accuracy", accuracy)
    overrides = {"num_landmarks": 4, "conv_kernel_size": 3} if attn_type == "nystrom" else None
    result = train_one(attn_type, tiny_splits(), RunSettings(**TINY, steps=4, eval_every=2), overrides)
    assert seen == [pad_to] * 3  # two dev evaluations, then the test
    assert result["padding"] == (f"to {pad_to} tokens" if pad_to else "to the longest row")


def test_the_train_time_leaves_out_the_evaluations(monkeypatch):
    from nystromformer.lra import train as lra_train
    clock = [1000.0]
    monkeypatch.setattr(lra_train.time, "time", lambda: clock[0])
    real = lra_train.accuracy

    def slow_accuracy(*args, **kwargs):  # each evaluation takes 100 s of the clock, each step none
        clock[0] += 100.0
        return real(*args, **kwargs)

    monkeypatch.setattr(lra_train, "accuracy", slow_accuracy)
    result = train_one("softmax", tiny_splits(), RunSettings(**TINY, steps=4, eval_every=2))
    assert result["train_seconds"] == 0.0 and result["eval_seconds"] == 300.0


def test_generation_that_draws_its_last_tree_on_its_last_try_returns_it():
    drawn = listops.generate(1, 0, max_depth=2, max_args=2, min_length=1, max_length=100, max_tries=2)
    assert listops.generate(1, 0, max_depth=2, max_args=2, min_length=1, max_length=100, max_tries=1) == drawn
