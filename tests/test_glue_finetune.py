"""Fine-tuning end to end on CPU: a tiny random-init "pretrained" checkpoint, the roberta tokenizer from
../shared, real SST-2 / STS-B subsets and our MNLI fixtures; sweeps; the command-line entry points."""
import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from nystromformer import atomic
from nystromformer.config import ModelConfig
from nystromformer.errors import UserError
from nystromformer.glue.commands import main as run_glue_main, settings_to_argv, settings_from_args
from nystromformer.glue.finetune import (FineTuningDiverged, FinetuneSettings, SettingsError, finetune, log_path,
                                        run_dir)
from nystromformer.glue.submission import read_submission
from nystromformer.glue.sweep import grid, run_sweep, summary_dir, write_summary
from nystromformer.model import NystromformerForMaskedLM, NystromformerForSequenceClassification

from helpers import WeightCasts

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "glue"


def make_model_folder(folder: Path, tokenizer_dir: Path, glue_dir: Path) -> Path:
    """A model folder with config.json and one pretraining checkpoint, cp-0000.model (random weights)."""
    from nystromformer.tokenizer import load_tokenizer

    model = ModelConfig(vocab_size=len(load_tokenizer(tokenizer_dir)), max_seq_len=128, embedding_dim=32,
                        transformer_dim=32, transformer_hidden_dim=64, num_layers=2, dropout_prob=0.0,
                        num_head=4, head_dim=8, attn_type="nystrom", num_landmarks=8, conv_kernel_size=5)
    config = {"model": dataclasses.asdict(model), "model_checkpoints": "model", "data_folder": "dataset",
              "glue_dataset_folder": str(glue_dir), "tokenizer": str(tokenizer_dir)}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    atomic.torch_save(folder / "model" / "cp-0000.model",
                      {"model_state_dict": NystromformerForMaskedLM(model).state_dict(), "epoch": 0, "step": 0})
    return folder


@pytest.fixture
def real_model_dir(shared_dir, tmp_path) -> Path:
    glue = shared_dir / "data" / "glue"
    if not glue.is_dir():
        pytest.skip(f"needs the real GLUE files at {glue}")
    return make_model_folder(tmp_path / "tiny", shared_dir / "tokenizers" / "roberta-base", glue)


@pytest.fixture
def fixture_model_dir(shared_dir, tmp_path) -> Path:
    return make_model_folder(tmp_path / "tiny", shared_dir / "tokenizers" / "roberta-base", FIXTURES)


def _tiny_classifier(tokenizer, num_labels: int, seed: int = 0):
    """A one-layer random classifier over the tokenizer's vocabulary, for evaluate()-level tests."""
    cfg = ModelConfig(vocab_size=len(tokenizer), max_seq_len=32, embedding_dim=16, transformer_dim=16,
                      transformer_hidden_dim=32, num_layers=1, num_head=2, head_dim=8, num_landmarks=4,
                      conv_kernel_size=3, dropout_prob=0.0)
    torch.manual_seed(seed)
    return NystromformerForSequenceClassification(cfg, num_labels)


@pytest.fixture(autouse=True)
def one_thread():
    # Two cores shared with other jobs: one thread is faster and keeps the float sums reproducible.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def quiet(_msg):
    pass


@pytest.mark.slow
def test_tiny_model_learns_sst2_beyond_the_majority_class(real_model_dir):
    settings = FinetuneSettings(task="SST-2", checkpoint=0, lr=3e-3, batch_size=32, epochs=4, seed=0,
                                max_seq_len=48, max_train_examples=1600, max_eval_examples=400, progress=False)
    result = finetune(real_model_dir, settings, log=quiet)

    ckpt = real_model_dir / "model"
    epochs_logged = [json.loads(line) for line in log_path(ckpt, settings).read_text().splitlines()]
    assert [entry["epoch"] for entry in epochs_logged] == [1, 2, 3, 4]
    assert all({"train_loss", "dev", "score"} <= set(entry) for entry in epochs_logged)
    assert log_path(ckpt, settings).name == "glue-SST-2-0-0.003-32-4-seed0-train1600.log"  # the paper's, + seed, subset

    # Majority class of the same 400 dev examples the run evaluated on.
    from nystromformer.glue.finetune import subsample
    from nystromformer.glue.tasks import TASKS, read_split
    glue_dir = Path(json.loads((real_model_dir / "config.json").read_text())["glue_dataset_folder"])
    labels = [e.label for e in subsample(read_split(glue_dir, TASKS["SST-2"], "dev").examples, 400)]
    majority = max(labels.count(0), labels.count(1)) / len(labels)
    assert result["best_score"] == max(entry["score"] for entry in epochs_logged)
    assert result["best_metrics"]["accuracy"] > majority + 0.05, (result["best_metrics"], majority)
    assert epochs_logged[-1]["train_loss"] < epochs_logged[0]["train_loss"] / 2

    # The best weights are saved and reproduce the best dev score; the submission has every test row.
    best = torch.load(run_dir(ckpt, settings) / "best.model", weights_only=True)
    assert best["epoch"] == result["best_epoch"] and best["dev"] == result["best_metrics"]
    rows = read_submission(run_dir(ckpt, settings) / "submission" / "SST-2.tsv")
    assert len(rows) == 1821 and [r[0] for r in rows[:3]] == ["0", "1", "2"]
    assert {r[1] for r in rows} <= {"0", "1"}


@pytest.mark.slow
def test_regression_on_sts_b_reduces_the_loss_and_correlates(real_model_dir):
    settings = FinetuneSettings(task="stsb", checkpoint=0, lr=3e-3, batch_size=32, epochs=3, seed=0, max_seq_len=64,
                                max_train_examples=640, max_eval_examples=300, progress=False)
    result = finetune(real_model_dir, settings, log=quiet)
    history = result["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert set(result["best_metrics"]) == {"pearson", "spearman"}
    assert result["best_metrics"]["pearson"] > 0.05
    # The shared STS-B folder has no test.tsv: reported, no submission, not a crash.
    assert result["submission"] == []


def test_sts_b_dev_subset_with_one_label_is_refused_before_training(real_model_dir):
    # Correlations of one label are undefined: every epoch would score NaN and the run be recorded as diverged.
    settings = FinetuneSettings(task="STS-B", checkpoint=0, epochs=1, max_train_examples=8, max_eval_examples=1,
                                progress=False)
    with pytest.raises(SettingsError, match=r"STS-B dev: the 1 dev example scored have one label .*"
                                            r"--max-eval-examples 1"):
        finetune(real_model_dir, settings, log=quiet)
    assert not (run_dir(real_model_dir / "model", settings) / "result.json").exists()


def test_three_class_task_with_two_dev_splits_writes_mnli_and_ax_submissions(fixture_model_dir):
    settings = FinetuneSettings(task="MNLI", checkpoint=0, lr=1e-3, batch_size=2, epochs=2, progress=False)
    messages = []
    result = finetune(fixture_model_dir, settings, log=messages.append)
    assert set(result["best_metrics"]) == {"accuracy_matched", "accuracy_mismatched"}
    out = run_dir(fixture_model_dir / "model", settings) / "submission"
    assert sorted(p.name for p in out.iterdir()) == ["AX.tsv", "MNLI-m.tsv", "MNLI-mm.tsv"]
    labels = {"entailment", "neutral", "contradiction"}
    for name, count in (("MNLI-m.tsv", 2), ("MNLI-mm.tsv", 1), ("AX.tsv", 3)):
        rows = read_submission(out / name)
        assert len(rows) == count and {r[1] for r in rows} <= labels


def test_malformed_rows_are_reported_while_fine_tuning(fixture_model_dir):
    settings = FinetuneSettings(task="QQP", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    messages = []
    result = finetune(fixture_model_dir, settings, log=messages.append)
    assert any("skipped 1 malformed row(s): train.tsv:4" in m for m in messages)
    assert result["malformed_rows_skipped"] == {"train": 1}  # recorded, not only logged
    assert set(result["best_metrics"]) == {"accuracy", "f1"}
    assert len(read_submission(run_dir(fixture_model_dir / "model", settings) / "submission" / "QQP.tsv")) == 3


def test_sweep_writes_a_summary_and_skips_finished_runs_when_rerun(fixture_model_dir):
    runs = grid(["MRPC"], lrs=[1e-3, 2e-3], batch_sizes=[2], checkpoint=0, epochs=2, progress=False)
    first = run_sweep(fixture_model_dir, runs, log=quiet)
    assert first["ran"] == ["MRPC-0-0.001-2-2", "MRPC-0-0.002-2-2"] and first["skipped"] == []
    summary = first["summary"]
    csv_lines = Path(summary["csv"]).read_text().splitlines()
    assert csv_lines[0] == "task,checkpoint,lr,batch_size,epochs,best_epoch,score,accuracy,f1,run,submission"
    assert len(csv_lines) == 3 and all(line.endswith(",MRPC.tsv") for line in csv_lines[1:])
    best = max(summary["rows"], key=lambda r: r["score"])
    # The best run's predictions are collected for the leaderboard, and what a full submission lacks is named.
    best_run = run_dir(fixture_model_dir / "model", next(s for s in runs if f"{s.lr:g}" == best["lr"]))
    collected = Path(summary["dir"]) / "submission" / "MRPC.tsv"
    assert collected.read_text() == (best_run / "submission" / "MRPC.tsv").read_text()
    markdown = Path(summary["markdown"]).read_text()
    assert "1 of the 11 files gluebenchmark.com expects" in markdown
    assert "* missing CoLA.tsv (no finished CoLA run)" in markdown
    # The settings the runs share, each as a value a reader can take in ("the model's" length, not None)
    assert f"Dev scores ×100 of the 2 finished run(s) of checkpoint 0 in {fixture_model_dir / 'model' / 'glue'} " \
           f"made with " in markdown
    assert "max_seq_len=the model's" in markdown and "max_train_examples=all" in markdown and "=None" not in markdown
    assert summary["best_per_task"] == {"MRPC": best} and summary["average"] == best["score"]
    assert summary["average_tasks"] == ["MRPC"] and summary["glue_average"] is None  # one task is not GLUE
    assert "Average of the best per task over MRPC (1 of 9 GLUE tasks" in markdown
    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A third configuration: only it runs; the finished two are skipped.
    more = runs + grid(["MRPC"], lrs=[3e-3], batch_sizes=[2], checkpoint=0, epochs=2, progress=False)
    second = run_sweep(fixture_model_dir, more, log=quiet)
    assert second["skipped"] == ["MRPC-0-0.001-2-2", "MRPC-0-0.002-2-2"] and second["ran"] == ["MRPC-0-0.003-2-2"]
    assert len(Path(second["summary"]["csv"]).read_text().splitlines()) == 4


def test_a_nystrom_run_padded_to_its_longest_example_or_evaluated_with_its_batch_is_redone_not_summarised(
        fixture_model_dir):
    # Before 2026-11-23 every batch was padded to its longest example, which moves a Nystrom model's predictions
    # with its batch: such a result is neither finished nor comparable, whatever its settings.
    runs = grid(["MRPC"], lrs=[1e-3], batch_sizes=[2], checkpoint=0, epochs=1, progress=False)
    first = run_sweep(fixture_model_dir, runs, log=quiet)
    path = run_dir(fixture_model_dir / "model", runs[0]) / "result.json"
    result = json.loads(path.read_text())
    assert first["ran"] == ["MRPC-0-0.001-2-1"] and result["padding"] == "to max_seq_len"
    assert result["evaluation"] == "each example alone"
    method = {"padding": "to max_seq_len", "evaluation": "each example alone"}
    for record, says in (("padding", "batches padded to the longest example -> to max_seq_len"),
                         ("evaluation", "examples evaluated with its batch -> each example alone")):
        # as a run before the record wrote it (padding: before 2026-11-23; evaluation: before 2026-11-24)
        path.write_text(json.dumps({k: v for k, v in result.items() if k != record}))
        said = []
        summary = write_summary(fixture_model_dir / "model", runs, log=said.append, method=method)
        assert summary["rows"] == [] and any(f"were made otherwise than this model's runs must be ({says}" in m
                                             for m in said), said
        said.clear()
        second = run_sweep(fixture_model_dir, runs, log=said.append)
        assert second["ran"] == ["MRPC-0-0.001-2-1"] and second["skipped"] == []
        assert any("replacing" in m and says in m for m in said), said
        redone = json.loads(path.read_text())
        assert (redone["padding"], redone["evaluation"]) == tuple(method.values())
        assert len(second["summary"]["rows"]) == 1


def test_settings_survive_the_round_trip_through_command_line_flags():
    import argparse
    from nystromformer.glue.commands import add_glue_arguments

    parser = argparse.ArgumentParser()
    add_glue_arguments(parser)
    # Every setting away from its default: a sweep's subprocess must run exactly what the grid asked for.
    settings = FinetuneSettings(task="RTE", checkpoint=3, lr=3e-5, batch_size=16, epochs=4, seed=7, max_seq_len=256,
                                warmup=0.1, weight_decay=0.05, max_train_examples=100, max_eval_examples=7,
                                submission=False, eval_batch_size=8, device="cpu", progress=False)
    defaults = FinetuneSettings(task="RTE", checkpoint=3)
    assert [f.name for f in dataclasses.fields(settings)
            if getattr(settings, f.name) == getattr(defaults, f.name)] == ["task", "checkpoint"]
    assert settings_from_args(parser.parse_args(settings_to_argv(settings))) == settings
    # and no flag at all is the settings' defaults
    assert settings_from_args(parser.parse_args(["--task", "RTE", "--checkpoint", "3"])) == defaults


def test_missing_checkpoint_lists_the_available_ones(fixture_model_dir, capsys):
    code = run_glue_main(["--model-dir", str(fixture_model_dir), "--task", "MRPC", "--checkpoint", "7"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no checkpoint cp-0007.model" in err and "available checkpoints: 0" in err


def test_run_glue_script_works_from_inside_a_model_folder(fixture_model_dir):
    # No PYTHONPATH: the script finds its package itself; --model-dir defaults to the current folder.
    proc = subprocess.run([sys.executable, str(REPO / "code" / "run_glue.py"), "--task", "MRPC", "--checkpoint", "7"],
                          cwd=fixture_model_dir, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(fixture_model_dir)})
    assert proc.returncode == 2, proc.stderr
    assert "no checkpoint cp-0007.model" in proc.stderr and "available checkpoints: 0" in proc.stderr


@pytest.mark.slow
def test_parallel_sweep_runs_each_configuration_in_its_own_subprocess(fixture_model_dir):
    # Two "devices" with CUDA_VISIBLE_DEVICES="" (no GPU): the same worker pool the GPU case uses.
    runs = grid(["QNLI"], lrs=[1e-3, 2e-3], batch_sizes=[2], checkpoint=0, epochs=1, progress=False, device="cpu")
    outcome = run_sweep(fixture_model_dir, runs, devices=["", ""], log=quiet)
    assert outcome["failed"] == [] and sorted(outcome["ran"]) == ["QNLI-0-0.001-2-1", "QNLI-0-0.002-2-1"]
    for settings in runs:
        out = run_dir(fixture_model_dir / "model", settings)
        assert (out / "result.json").is_file()
        assert (out / "console.txt").read_text().startswith("--- ")   # each attempt appended under a line
        assert len(read_submission(out / "submission" / "QNLI.tsv")) == 2
    assert len(outcome["summary"]["rows"]) == 2


def test_a_finished_run_counts_only_for_the_settings_it_was_run_with(tmp_path):
    import dataclasses
    import json as _json

    from nystromformer.glue.finetune import FinetuneSettings, read_result, run_dir
    settings = FinetuneSettings(task="RTE", checkpoint=0, lr=2e-5, batch_size=16, epochs=2, max_train_examples=100)
    folder = run_dir(tmp_path, settings)
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(_json.dumps({"settings": dataclasses.asdict(settings), "best_score": 0.5}))
    assert read_result(tmp_path, settings)["best_score"] == 0.5
    assert read_result(tmp_path, dataclasses.replace(settings, progress=False, device="cpu")) is not None
    assert read_result(tmp_path, dataclasses.replace(settings, max_train_examples=None)) is None
    assert read_result(tmp_path, dataclasses.replace(settings, seed=1)) is None


def test_runs_differing_in_seed_or_training_subset_get_their_own_names(tmp_path):
    base = FinetuneSettings(task="SST-2", checkpoint=3, lr=2e-5, batch_size=32, epochs=5)
    assert base.run_name == "SST-2-3-2e-05-32-5"  # default settings keep the documented name
    variants = [base, dataclasses.replace(base, seed=7), dataclasses.replace(base, max_train_examples=500),
                dataclasses.replace(base, seed=7, max_train_examples=500)]
    assert [v.run_name for v in variants] == ["SST-2-3-2e-05-32-5", "SST-2-3-2e-05-32-5-seed7",
                                              "SST-2-3-2e-05-32-5-train500", "SST-2-3-2e-05-32-5-seed7-train500"]
    assert len({run_dir(tmp_path, v) for v in variants}) == len({log_path(tmp_path, v) for v in variants}) == 4
    assert [summary_dir(tmp_path, v).name for v in variants] == ["sweep-3", "sweep-3-seed7", "sweep-3-train500",
                                                                 "sweep-3-seed7-train500"]
    # Sweeps with other score-changing settings keep their own summaries; lr and batch size are what a sweep varies
    longer, warmer = dataclasses.replace(base, epochs=10), dataclasses.replace(base, warmup=0.1)
    names = {summary_dir(tmp_path, v).name for v in (longer, warmer, dataclasses.replace(longer, lr=5e-5))}
    assert len(names) == 2 and all(name.startswith("sweep-3-") and name != "sweep-3-seed7" for name in names)
    assert summary_dir(tmp_path, dataclasses.replace(base, lr=5e-5, batch_size=16, task="RTE")).name == "sweep-3"


def test_replacing_a_run_made_with_other_settings_is_announced(fixture_model_dir):
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    finetune(fixture_model_dir, settings, log=quiet)
    messages = []
    finetune(fixture_model_dir, dataclasses.replace(settings, warmup=0.1), log=messages.append)
    assert any(m.startswith("warning: replacing ") and "warmup 0.06 -> 0.1" in m for m in messages), messages


def test_max_seq_len_given_as_the_models_own_is_the_same_run_as_the_default(fixture_model_dir):
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False,
                                submission=False)
    finetune(fixture_model_dir, dataclasses.replace(settings, max_seq_len=128), log=quiet)   # the model's 128
    said = []
    result = run_sweep(fixture_model_dir, [settings], log=said.append)
    assert result["skipped"] == [settings.run_name] and not any("replacing" in m for m in said), said
    assert result["summary"]["dir"] == str(summary_dir(fixture_model_dir / "model", settings))
    assert len(result["summary"]["rows"]) == 1


def test_asking_a_run_made_without_test_predictions_for_them_writes_them_without_training_again(fixture_model_dir):
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    finetune(fixture_model_dir, dataclasses.replace(settings, submission=False), log=quiet)
    out = run_dir(fixture_model_dir / "model", settings)
    trained = (out / "best.model").stat().st_mtime_ns
    assert not (out / "submission").exists()
    said = []
    result = finetune(fixture_model_dir, settings, log=said.append)
    assert any("its submission was not made (--no-submission); redoing only the submission" in m for m in said), said
    assert not any("replacing" in m for m in said) and (out / "best.model").stat().st_mtime_ns == trained
    assert (out / "submission" / "MRPC.tsv").is_file() and result["settings"]["submission"] is True
    # finished now, with or without a submission asked for; --no-submission does not retrain a run to drop one
    assert run_sweep(fixture_model_dir, [settings], log=quiet)["skipped"] == [settings.run_name]
    no_files = dataclasses.replace(settings, submission=False)
    assert run_sweep(fixture_model_dir, [no_files], log=quiet)["skipped"] == [settings.run_name]


def test_rerunning_a_finished_run_does_nothing_and_without_a_submission_keeps_the_one_it_has(fixture_model_dir):
    # As `pretrain` on a finished run: `glue` with the settings of a finished run neither trains again nor
    # deletes its test predictions, with or without --no-submission; it says so and returns the stored result.
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    first = finetune(fixture_model_dir, settings, log=quiet)
    out = run_dir(fixture_model_dir / "model", settings)
    trained, predicted = ((out / name).stat().st_mtime_ns for name in ("best.model", "submission/MRPC.tsv"))
    for again in (settings, dataclasses.replace(settings, submission=False)):
        said = []
        result = finetune(fixture_model_dir, again, log=said.append)
        assert any(m.startswith(f"{out}: finished earlier with these settings (best dev score ")
                   and m.endswith("nothing to do. To train it again, delete that folder") for m in said), said
        assert result == first
        assert (out / "best.model").stat().st_mtime_ns == trained
        assert (out / "submission" / "MRPC.tsv").stat().st_mtime_ns == predicted
    (out / "best.model").unlink()   # weights deleted to save disk once the scores and predictions are in
    said = []
    assert finetune(fixture_model_dir, settings, log=said.append) == first and "nothing to do" in said[-1], said
    assert run_sweep(fixture_model_dir, [settings], log=quiet)["skipped"] == [settings.run_name]


def test_the_start_message_counts_examples_and_steps_in_plain_words(fixture_model_dir):
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=8, epochs=1, progress=False,
                                submission=False)
    messages = []
    finetune(fixture_model_dir, settings, log=messages.append)
    # ... and names the Nyström formulation (with the fast path's switches where it runs) behind the scores
    assert any(m.endswith("on MRPC: 3 train examples, 2 dev examples, 1 step on cpu; Nyström attention: the "
                          "reference formulation on cpu") for m in messages), messages


def sweep_command(model_dir, *flags):
    from nystromformer.cli import main
    return main(["glue-sweep", "--model-dir", str(model_dir), "--checkpoint", "0", "--lrs", "1e-3", "--batch-sizes",
                 "2", "--epoch", "1", "--no-progress", *flags])


def test_a_sweep_of_some_tasks_summarises_every_finished_run_and_names_the_tasks_it_averages(fixture_model_dir,
                                                                                            capsys):
    assert sweep_command(fixture_model_dir, "--tasks", "MRPC") == 0
    assert sweep_command(fixture_model_dir, "--tasks", "MRPC, QNLI") == 0  # (MRPC's run is done: skipped)
    out = capsys.readouterr().out
    [summary] = (fixture_model_dir / "model" / "glue").glob("sweep-0*")  # one summary (epochs 1: a hashed name)
    rows = (summary / "summary.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows] == ["MRPC", "QNLI"]  # the first sweep's run is still summarised
    [average] = [line for line in out.splitlines() if "average" in line][-1:]
    assert "MRPC, QNLI" in average and "2 of 9" in average and not average.startswith("GLUE average"), average
    assert "2 of 9 GLUE tasks" in (summary / "summary.md").read_text()


def write_finished_run(checkpoint_dir: Path, settings: FinetuneSettings, score: float) -> None:
    """A result.json as a finished run writes it (the fields the summary reads)."""
    out = run_dir(checkpoint_dir, settings)
    out.mkdir(parents=True)
    (out / "result.json").write_text(json.dumps({
        "settings": dataclasses.asdict(settings), "best_epoch": 0, "best_score": score,
        "best_metrics": {"accuracy": score}, "history": [{"epoch": 0, "score": score}], "submission_errors": []}))


def test_the_glue_average_covers_all_nine_tasks_and_is_not_claimed_when_one_of_them_diverged(tmp_path):
    from nystromformer.glue.tasks import TASKS
    runs = grid(list(TASKS), lrs=[1e-3], batch_sizes=[2], checkpoint=0, epochs=2)
    for i, settings in enumerate(runs):
        write_finished_run(tmp_path, settings, 0.5 + i / 100)
    summary = write_summary(tmp_path, runs, log=quiet)
    assert summary["average_tasks"] == list(TASKS) and summary["glue_average"] == summary["average"]
    assert summary["average_label"] == "GLUE average (best per task, all 9 tasks)"
    write_finished_run(tmp_path / "other", runs[0], float("nan"))  # every run of the first task diverged
    for i, settings in enumerate(runs[1:], 1):
        write_finished_run(tmp_path / "other", settings, 0.5 + i / 100)
    summary = write_summary(tmp_path / "other", runs, log=quiet)
    assert summary["diverged_tasks"] == [runs[0].task] and len(summary["average_tasks"]) == 8
    assert summary["glue_average"] is None  # the average of 8 tasks is not the GLUE average
    assert "GLUE average (best per task" not in Path(summary["markdown"]).read_text()


def test_a_summary_compares_only_runs_made_with_the_sweep_s_settings_and_says_what_it_left_out(tmp_path):
    runs = grid(["RTE"], lrs=[1e-3, 2e-3], batch_sizes=[2], checkpoint=0, epochs=2)
    for settings, score in zip(runs, (0.5, 0.6)):
        write_finished_run(tmp_path, settings, score)
    # Better scores, but not comparable: a longer schedule, and a longer warm-up on a smaller dev subset.
    write_finished_run(tmp_path, dataclasses.replace(runs[0], epochs=5), 0.9)
    write_finished_run(tmp_path, dataclasses.replace(runs[0], lr=3e-3, warmup=0.1, max_eval_examples=10), 0.8)
    messages = []
    summary = write_summary(tmp_path, runs, log=messages.append)
    assert [(r["lr"], r["epochs"], r["score"]) for r in summary["rows"]] == [("0.001", 2, 0.5), ("0.002", 2, 0.6)]
    assert summary["best_per_task"]["RTE"]["score"] == 0.6
    [warning] = [m for m in messages if m.startswith("warning:")]
    assert "2 finished run(s)" in warning, warning
    assert "epochs 5 instead of 2; max_eval_examples 10 instead of None; warmup 0.1 instead of 0.06" in warning
    assert "epochs=2" in Path(summary["markdown"]).read_text() and summary["settings"]["epochs"] == 2


def test_a_task_whose_every_run_diverged_is_left_out_of_the_average_and_named(tmp_path):
    rte, cola = grid(["RTE", "CoLA"], lrs=[1e-3], batch_sizes=[2], checkpoint=0, epochs=2)
    write_finished_run(tmp_path, rte, 0.6)
    write_finished_run(tmp_path, cola, float("nan"))  # as a diverged run's result.json records it
    summary = write_summary(tmp_path, [rte, cola], log=quiet)
    assert summary["average"] == 0.6 and summary["average_tasks"] == ["RTE"] and summary["diverged_tasks"] == ["CoLA"]
    assert summary["average_label"].endswith("left out, every run diverged: CoLA")
    assert "over RTE (1 of 9 GLUE tasks" in Path(summary["markdown"]).read_text()
    for settings in (rte, cola):
        write_finished_run(tmp_path / "other", settings, float("nan"))
    only_diverged = write_summary(tmp_path / "other", [rte, cola], log=quiet)
    assert only_diverged["average"] is None
    assert "No average: every run of CoLA, RTE diverged." in Path(only_diverged["markdown"]).read_text()


def test_a_sweep_whose_runs_differ_beyond_task_lr_and_batch_size_is_refused(fixture_model_dir):
    runs = grid(["RTE"], lrs=[1e-3], batch_sizes=[2], checkpoint=0, epochs=2)
    runs.append(dataclasses.replace(runs[0], lr=2e-3, warmup=0.1))
    with pytest.raises(SettingsError, match="must share every setting but task, lr, batch_size"):
        run_sweep(fixture_model_dir, runs, log=quiet)


def test_a_test_file_with_a_bad_row_fails_the_run_and_a_rerun_redoes_only_the_submission(shared_dir, tmp_path,
                                                                                        capsys):
    glue = tmp_path / "glue"
    shutil.copytree(FIXTURES / "MRPC", glue / "MRPC")
    test_file = glue / "MRPC" / "test.tsv"
    good = test_file.read_text()
    test_file.write_text(good + "2\tonly\tfour\tfields\n")
    model_dir = make_model_folder(tmp_path / "tiny", shared_dir / "tokenizers" / "roberta-base", glue)
    argv = ["--model-dir", str(model_dir), "--task", "MRPC", "--checkpoint", "0", "--lr", "1e-3", "--batch_size", "2",
            "--epoch", "1", "--no-progress"]
    assert run_glue_main(argv) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # after any warning
    assert error.startswith("error: ") and "test.tsv:4" in error and "MRPC.tsv not written" in error, error
    settings = settings_from_args_for(argv)
    out = run_dir(model_dir / "model", settings)
    trained = {p: p.stat().st_mtime_ns for p in (out / "best.model", log_path(model_dir / "model", settings))}
    assert not (out / "submission" / "MRPC.tsv").exists()

    # A sweep does not take the run for finished: it retries (only) the submission, which fails again.
    outcome = run_sweep(model_dir, [settings], log=quiet)
    assert outcome["skipped"] == [] and outcome["failed"] == [settings.run_name]

    test_file.write_text(good)
    assert run_glue_main(argv) == 0
    assert len(read_submission(out / "submission" / "MRPC.tsv")) == 2
    assert {p: p.stat().st_mtime_ns for p in trained} == trained  # not trained again
    result = json.loads((out / "result.json").read_text())
    assert result["submission"] == [str(out / "submission" / "MRPC.tsv")] and result["submission_errors"] == []
    assert run_sweep(model_dir, [settings], log=quiet)["skipped"] == [settings.run_name]


def test_an_absent_test_file_is_reported_and_a_rerun_writes_only_that_submission_once_it_is_there(shared_dir,
                                                                                                   tmp_path):
    glue = tmp_path / "glue"
    shutil.copytree(FIXTURES / "MNLI", glue / "MNLI")  # no diagnostic/ yet: AX.tsv cannot be written
    model_dir = make_model_folder(tmp_path / "tiny", shared_dir / "tokenizers" / "roberta-base", glue)
    settings = FinetuneSettings(task="MNLI", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    messages = []
    result = finetune(model_dir, settings, log=messages.append)
    assert result["submission_missing"] == ["AX.tsv"] and result["submission_errors"] == []
    assert any(m.startswith("no AX.tsv submission: no diagnostic (AX) file under") for m in messages)
    out = run_dir(model_dir / "model", settings)
    still_absent = run_sweep(model_dir, [settings], log=quiet)
    assert still_absent["skipped"] == [settings.run_name]  # still absent: finished
    assert ("* missing AX.tsv (MNLI's best run MNLI-0-0.001-2-1: its test file was absent; rerun it once the file "
            "is there)") in Path(still_absent["summary"]["markdown"]).read_text()

    shutil.copytree(FIXTURES / "diagnostic", glue / "diagnostic")
    trained = (out / "best.model").stat().st_mtime_ns
    outcome = run_sweep(model_dir, [settings], log=messages.append)
    assert outcome["ran"] == [settings.run_name]
    assert any("lacks a file whose test file is there now; redoing only the submission" in m for m in messages)
    assert (out / "best.model").stat().st_mtime_ns == trained
    assert sorted(p.name for p in (out / "submission").iterdir()) == ["AX.tsv", "MNLI-m.tsv", "MNLI-mm.tsv"]
    assert json.loads((out / "result.json").read_text())["submission_missing"] == []


@pytest.mark.parametrize("broken", ["wrong header", "header only", "not UTF-8"])
def test_a_test_file_that_is_there_but_unusable_fails_the_run(shared_dir, tmp_path, capsys, broken):
    glue = tmp_path / "glue"
    shutil.copytree(FIXTURES / "MRPC", glue / "MRPC")
    test_file = glue / "MRPC" / "test.tsv"
    lines = test_file.read_text().splitlines(keepends=True)
    if broken == "wrong header":  # the raw msr_paraphrase_test.txt layout, not GLUE's
        test_file.write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n" + "".join(lines[1:]))
    elif broken == "header only":
        test_file.write_text(lines[0])
    else:
        test_file.write_bytes(test_file.read_bytes() + "2\t1\t2\tcaf\u00e9\tcaf\u00e9\n".encode("latin-1"))
    model_dir = make_model_folder(tmp_path / "tiny", shared_dir / "tokenizers" / "roberta-base", glue)
    argv = ["--model-dir", str(model_dir), "--task", "MRPC", "--checkpoint", "0", "--lr", "1e-3", "--batch_size", "2",
            "--epoch", "1", "--no-progress"]
    assert run_glue_main(argv) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after any warning
    expected = {"wrong header": "no column 'index' in the header", "header only": "no rows after the header",
                "not UTF-8": f"test.tsv:{len(lines) + 1}: not UTF-8 (invalid continuation byte)"}[broken]
    assert err.startswith("error: ") and expected in err and "MRPC.tsv not written" in err, err
    # Trained and recorded: a rerun after fixing the file redoes only the submission.
    result = json.loads((model_dir / "model" / "glue" / "MRPC-0-0.001-2-1" / "result.json").read_text())
    assert result["submission_errors"]
    run = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    summary = write_summary(model_dir / "model", [run], log=quiet)
    assert ("* missing MRPC.tsv (MRPC's best run MRPC-0-0.001-2-1: its test file could not be used: see "
            "submission_errors in its result.json)") in Path(summary["markdown"]).read_text()


def test_a_diverged_run_is_an_error_recorded_as_finished_without_a_submission_of_nan_predictions(fixture_model_dir):
    cp = fixture_model_dir / "model" / "cp-0000.model"
    state = torch.load(cp, weights_only=True)
    state["model_state_dict"]["encoder.embeddings.word_embeddings.weight"].fill_(float("nan"))
    atomic.torch_save(cp, state)
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=2, progress=False)
    with pytest.raises(FineTuningDiverged, match=r"MRPC: no epoch has a finite dev score: the model's outputs are "
                                                 r"NaN or infinite .* no submission written"):
        finetune(fixture_model_dir, settings, log=quiet)
    out = run_dir(fixture_model_dir / "model", settings)
    result = json.loads((out / "result.json").read_text())
    assert result["diverged"] and math.isnan(result["best_score"]) and not (out / "submission").exists()
    # (NaN logits would argmax to class 0: a dev accuracy that means nothing; the scores are NaN instead.)
    assert all(math.isnan(v) for epoch in result["history"] for v in epoch["dev"].values())
    rerun = run_sweep(fixture_model_dir, [settings], log=quiet)
    assert rerun["skipped"] == [settings.run_name]  # rerun: same end
    assert "* missing MRPC.tsv (MRPC's best run MRPC-0-0.001-2-2: diverged, no submission)" in \
        Path(rerun["summary"]["markdown"]).read_text()
    recorded = (out / "result.json").stat().st_mtime_ns
    with pytest.raises(FineTuningDiverged, match=r"finished earlier with these settings, and diverged .*nothing to "
                                                 r"do"):
        finetune(fixture_model_dir, settings, log=quiet)   # `glue` again: the same end, not another run
    assert (out / "result.json").stat().st_mtime_ns == recorded


def test_a_diverged_run_made_without_test_predictions_is_not_redone_when_they_are_asked_for(fixture_model_dir):
    # Its best.model holds the NaN weights: there is nothing to predict the test files with.
    cp = fixture_model_dir / "model" / "cp-0000.model"
    state = torch.load(cp, weights_only=True)
    state["model_state_dict"]["encoder.embeddings.word_embeddings.weight"].fill_(float("nan"))
    atomic.torch_save(cp, state)
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False,
                                submission=False)
    with pytest.raises(FineTuningDiverged, match=r"no epoch has a finite dev score"):
        finetune(fixture_model_dir, settings, log=quiet)
    wanted = dataclasses.replace(settings, submission=True)
    assert run_sweep(fixture_model_dir, [wanted], log=quiet)["skipped"] == [settings.run_name]
    with pytest.raises(FineTuningDiverged, match=r"finished earlier with these settings, and diverged"):
        finetune(fixture_model_dir, wanted, log=quiet)
    assert json.loads((run_dir(fixture_model_dir / "model", settings) / "result.json").read_text())[
        "submission_errors"] == []


def test_the_collected_submission_does_not_depend_on_the_directory_a_sweep_is_run_from(fixture_model_dir,
                                                                                       monkeypatch):
    runs = grid(["MRPC"], lrs=[1e-3], batch_sizes=[2], checkpoint=0, epochs=1, progress=False)
    monkeypatch.chdir(fixture_model_dir.parent)
    first = run_sweep(fixture_model_dir.name, runs, log=quiet)["summary"]  # result.json's paths: relative to here
    monkeypatch.chdir(fixture_model_dir)
    again = run_sweep(".", runs, log=quiet)
    assert again["skipped"] == [runs[0].run_name]
    collected = Path(again["summary"]["dir"]) / "submission" / "MRPC.tsv"
    assert collected.is_file() and collected.read_text() == (fixture_model_dir.parent / first["dir"] / "submission" /
                                                             "MRPC.tsv").read_text()
    assert "missing MRPC.tsv" not in Path(again["summary"]["markdown"]).read_text()


def settings_from_args_for(argv):
    import argparse
    from nystromformer.glue.commands import add_glue_arguments

    parser = argparse.ArgumentParser()
    add_glue_arguments(parser)
    return settings_from_args(parser.parse_args(argv))


def test_the_majority_baseline_and_a_classifier_that_predicts_one_class_are_reported(shared_dir):
    from nystromformer.glue.encoding import EncodedDataset, PadCollator
    from nystromformer.glue.finetune import Runner, evaluate, majority_baseline
    from nystromformer.glue.tasks import TASKS, Example
    from nystromformer.tokenizer import load_tokenizer

    rte = TASKS["RTE"]
    train = [Example(str(i), "a", "b", label) for i, label in enumerate([1, 1, 1, 0])]
    dev_labels = {"dev": [1, 0, 0, 0, 1]}
    assert majority_baseline(rte, train, dev_labels) == pytest.approx(0.4)  # always 1 (not_entailment): 2 of 5
    assert majority_baseline(TASKS["STS-B"], train, dev_labels) is None

    tokenizer = load_tokenizer(shared_dir / "tokenizers" / "roberta-base")
    model = _tiny_classifier(tokenizer, 2)
    with torch.no_grad():  # a degenerate classifier: class 0 whatever the input
        model.classifier.out_proj.weight.zero_()
        model.classifier.out_proj.bias.copy_(torch.tensor([1.0, 0.0]))
    dev = [Example(str(i), f"sentence {i}", "another one", label) for i, label in enumerate(dev_labels["dev"])]
    loader = DataLoader(EncodedDataset(dev, tokenizer, 32, False), batch_size=2,
                        collate_fn=PadCollator(tokenizer.pad_token_id, False))
    metrics, one_class = evaluate(Runner(model, torch.device("cpu"), False), rte, {"dev": loader}, dev_labels)
    assert one_class == ["dev"] and metrics["accuracy"] == pytest.approx(0.6)


def test_a_prediction_does_not_depend_on_its_batch_mates_or_the_eval_batch_size(shared_dir):
    # Nystrom's "original" pseudo-inverse init scales by a maximum over the batch: evaluated with its batch, an
    # example's logits moved with the others in it (and --eval-batch-size changed dev scores). Each example alone.
    from nystromformer.glue.encoding import EncodedDataset, PadCollator
    from nystromformer.glue.finetune import Runner
    from nystromformer.glue.tasks import Example
    from nystromformer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(shared_dir / "tokenizers" / "roberta-base")
    model = _tiny_classifier(tokenizer, 2)
    assert model.config.inv_coeff_init_option == "original"
    texts = ["a short one", "a much longer sentence " * 5, "x", "the cat sat on the mat", "words " * 9, "ok"]
    examples = [Example(str(i), t, None, 0) for i, t in enumerate(texts)]
    runner = Runner(model, torch.device("cpu"), False)

    def logits(batch_size):
        return runner.predict(DataLoader(EncodedDataset(examples, tokenizer, 32, False), batch_size=batch_size,
                                         collate_fn=PadCollator(tokenizer.pad_token_id, False, pad_to=32)))
    alone = logits(1)
    for batch_size in (2, 6):
        assert np.abs(logits(batch_size) - alone).max() < 1e-6   # with its batch: 1.2e-5 here
    assert all(m.init_rows is None for m in model.modules() if hasattr(m, "init_rows"))  # training: the batch's


def test_predictions_are_made_in_eval_mode_and_the_next_epoch_trains_in_train_mode(shared_dir):
    # Dropout (as Performer's redraws and Reformer's hashing) in a prediction would move dev scores and test files
    # from one evaluation to the next; an epoch after an evaluation must train with it again.
    from nystromformer.glue.encoding import EncodedDataset, PadCollator
    from nystromformer.glue.finetune import Runner, build_optimizer, train_one_epoch
    from nystromformer.glue.tasks import Example
    from nystromformer.runtime import linear_warmup_decay
    from nystromformer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(shared_dir / "tokenizers" / "roberta-base")
    model = _tiny_classifier(tokenizer, 2)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    examples = [Example(str(i), t, None, i % 2) for i, t in enumerate(["a short one", "the cat sat", "x", "ok"])]
    loader = DataLoader(EncodedDataset(examples, tokenizer, 32, False), batch_size=2,
                        collate_fn=PadCollator(tokenizer.pad_token_id, False, pad_to=32))
    runner = Runner(model, torch.device("cpu"), False)
    first = runner.predict(loader)
    assert np.array_equal(runner.predict(loader), first)

    class Bar(list):
        def set_postfix(self, **kwargs):
            pass
    modes = []
    model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    optimizer = build_optimizer(model, 1e-3, 0.0)
    train_one_epoch(runner, Bar(loader), optimizer, linear_warmup_decay(optimizer, len(loader), 0))
    assert modes == [True, True]


def test_predictions_that_overflow_fp16_are_made_again_in_fp32(shared_dir):
    # GPUs without bf16 fine-tune in fp16 (CPU autocast has it too): logits beyond its range must not become inf.
    from nystromformer.glue.encoding import EncodedDataset, PadCollator
    from nystromformer.glue.finetune import Runner
    from nystromformer.glue.tasks import Example
    from nystromformer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(shared_dir / "tokenizers" / "roberta-base")
    model = _tiny_classifier(tokenizer, 2)
    with torch.no_grad():
        model.classifier.out_proj.weight.fill_(1e7)  # weights and logits beyond fp16's 65504
    dev = [Example(str(i), f"sentence {i}", "another one", 0) for i in range(3)]
    loader = DataLoader(EncodedDataset(dev, tokenizer, 32, False), batch_size=2,
                        collate_fn=PadCollator(tokenizer.pad_token_id, False))
    runner = Runner(model, torch.device("cpu"), False)
    runner.amp, runner.amp_dtype = True, torch.float16
    outputs = runner.predict(loader)
    assert np.isfinite(outputs).all() and np.abs(outputs).max() > 65504
    assert runner.amp  # fp16 again for what follows


def test_mixed_precision_predictions_cast_each_weight_once_for_all_the_batches():
    # One autocast region (and model.fixed_weights) for the whole prediction: the weights cannot change meanwhile.
    from nystromformer.glue.finetune import Runner
    cfg = ModelConfig(vocab_size=40, max_seq_len=32, embedding_dim=16, transformer_dim=16, transformer_hidden_dim=32,
                      num_layers=2, num_head=2, head_dim=8, num_landmarks=4, conv_kernel_size=3, dropout_prob=0.0)
    model = NystromformerForSequenceClassification(cfg, 2)
    batches = [{"input_ids": torch.randint(5, 40, (2, 32)), "attention_mask": torch.ones(2, 32, dtype=torch.long)}
               for _ in range(3)]
    runner = Runner(model, torch.device("cpu"), False)
    runner.amp, runner.amp_dtype = True, torch.bfloat16
    with WeightCasts() as casts:
        outputs = runner.predict(batches)
    assert outputs.shape == (6, 2)
    params = casts.of_parameters(model)
    assert max(params.values()) == 1 and params["classifier.out_proj.weight"] == 1
    assert casts.of_joined_qkv(model) == cfg.num_layers


@pytest.mark.parametrize("flags, named", [
    (["glue-sweep", "--lrs", ""], "--lrs: give at least one value"),
    (["glue-sweep", "--batch-sizes", ""], "--batch-sizes: give at least one value"),
    (["glue", "--task", "RTE", "--max-train-examples", "0"], "--max-train-examples: must be at least 1, got 0"),
    (["glue", "--task", "RTE", "--eval-batch-size", "0"], "--eval-batch-size: must be at least 1, got 0"),
])
def test_empty_grids_and_non_positive_sizes_are_one_error_line(tmp_path, capsys, flags, named):
    from nystromformer.cli import main
    assert main([*flags, "--model-dir", str(tmp_path), "--checkpoint", "0"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {named}\n"


def test_a_rerun_interrupted_after_its_first_weights_leaves_no_result_of_the_run_it_replaces(fixture_model_dir,
                                                                                          monkeypatch):
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    finetune(fixture_model_dir, settings, log=quiet)
    out = run_dir(fixture_model_dir / "model", settings)
    epoch_log = fixture_model_dir / "model" / f"glue-{settings.run_name}.log"
    assert (out / "result.json").is_file() and (out / "submission" / "MRPC.tsv").is_file() and epoch_log.is_file()

    def killed(*args, **kwargs):  # the rerun dies (kill -9, a crash) right after its first best.model
        raise KeyboardInterrupt
    monkeypatch.setattr("nystromformer.glue.finetune.atomic.write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        finetune(fixture_model_dir, dataclasses.replace(settings, warmup=0.1), log=quiet)
    # The old scores, test predictions and epoch log would describe the new weights: gone; the run counts as
    # unfinished and a sweep redoes it.
    assert (out / "best.model").is_file() and not (out / "result.json").exists()
    assert not (out / "submission").exists() and not epoch_log.exists()
    monkeypatch.undo()
    assert run_sweep(fixture_model_dir, [settings], log=quiet)["ran"] == [settings.run_name]


def test_a_checkpoint_of_another_architecture_is_refused_not_fine_tuned_from_random_layers(fixture_model_dir):
    config = json.loads((fixture_model_dir / "config.json").read_text())
    config["model"]["num_layers"] = 3
    (fixture_model_dir / "config.json").write_text(json.dumps(config))
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    with pytest.raises(UserError, match=r"cp-0000.model: lacks encoder weight encoder\.layers\.2\.\S+ \(and \d+ "
                                        r"more\) for the model config.json describes"):
        finetune(fixture_model_dir, settings, log=quiet)
    config["model"]["num_layers"] = 1
    (fixture_model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"has an extra encoder weight encoder\.layers\.1\."):
        finetune(fixture_model_dir, settings, log=quiet)


def test_a_run_named_twice_in_a_grid_is_run_once_in_the_order_first_given():
    runs = grid(["WNLI", "RTE", "wnli"], lrs=[1e-3, 2e-3, 0.001], batch_sizes=[4, 4], checkpoint=0)
    assert [s.run_name for s in runs] == ["WNLI-0-0.001-4-5", "WNLI-0-0.002-4-5", "RTE-0-0.001-4-5",
                                          "RTE-0-0.002-4-5"]


def test_two_different_runs_that_would_share_a_name_are_refused_not_one_dropped():
    with pytest.raises(SettingsError, match="would share the run name WNLI-0-1e-05-4-5"):
        grid(["WNLI"], lrs=[1e-5, 1.0000001e-5], batch_sizes=[4], checkpoint=0)


def test_a_finished_sweep_summarises_again_without_its_pretraining_checkpoint(fixture_model_dir):
    runs = grid(["MRPC"], lrs=[1e-3], batch_sizes=[2], checkpoint=0, epochs=1, progress=False)
    assert run_sweep(fixture_model_dir, runs, log=quiet)["ran"] == [runs[0].run_name]
    (fixture_model_dir / "model" / "cp-0000.model").unlink()  # moved away after fine-tuning: not needed any more
    outcome = run_sweep(fixture_model_dir, runs, log=quiet)
    assert outcome["skipped"] == [runs[0].run_name] and len(outcome["summary"]["rows"]) == 1


@pytest.mark.parametrize("flags, named", [
    (["--lr", "nan"], "--lr: must be a positive number, got nan"),
    (["--lr", "inf"], "--lr: must be a positive number, got inf"),
    (["--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
    (["--epochs", "0"], "--epoch: must be at least 1, got 0"),
    (["--warmup", "1"], "--warmup: is the fraction of the steps warming up, in [0, 1), got 1.0"),
    (["--weight-decay", "-5"], "--weight-decay: must be a number >= 0, got -5.0"),
    (["--weight-decay", "nan"], "--weight-decay: must be a number >= 0, got nan"),
    (["--seed", "-1"], "--seed: must be in [0, 2^32) (numpy's seeds), got -1"),
    (["--max-seq-len", "5"], "--max-seq-len: must be at least 6 for RTE"),
])
def test_impossible_fine_tuning_settings_are_one_error_line_naming_the_flag(tmp_path, capsys, flags, named):
    from nystromformer.cli import main
    assert main(["glue", "--task", "RTE", *flags, "--model-dir", str(tmp_path), "--checkpoint", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}") and len(err.splitlines()) == 1, err


def test_a_single_sentence_task_needs_three_tokens_a_pair_task_six(tmp_path, capsys):
    # <s> text </s>, or <s> a </s></s> b </s>: one token of each text at least, or truncation could not apply
    from nystromformer.cli import main
    for task, shortest in (("CoLA", 3), ("RTE", 6)):
        assert main(["glue", "--task", task, "--max-seq-len", str(shortest - 1), "--model-dir", str(tmp_path),
                     "--checkpoint", "0"]) == 2
        assert capsys.readouterr().err.startswith(f"error: --max-seq-len: must be at least {shortest} for {task}")
        main(["glue", "--task", task, "--max-seq-len", str(shortest), "--model-dir", str(tmp_path),
              "--checkpoint", "0"])                        # fails later (no model here), not on the length
        assert "--max-seq-len" not in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--checkpoint", "7"], "no checkpoint cp-0007.model in "),
    (["--checkpoint", "0", "--device", "gpu"], "--device gpu: not a device"),
    (["--checkpoint", "0", "--lrs", "nan"], "--lr: must be a positive number, got nan"),
    (["--checkpoint", "0", "--max-seq-len", "192"], "--max-seq-len: 192 is longer than the model's max_seq_len 128"),
    (["--checkpoint", "0", "--devices", "0,,1"], "--devices 0,,1: an empty entry"),
    (["--checkpoint", "0", "--devices", "0,1", "--device", "cuda:1"],
     "--device cuda:1 with --devices 0,1: each run sees only its own GPU"),
])
def test_a_sweep_that_would_fail_every_run_is_one_error_line_before_the_first(fixture_model_dir, capsys, flags,
                                                                               named):
    from nystromformer.cli import main
    assert main(["glue-sweep", "--tasks", "MRPC", "--model-dir", str(fixture_model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}") and len(err.splitlines()) == 1, err
    assert not (fixture_model_dir / "model" / "glue").exists()


def test_stopping_a_parallel_sweep_stops_the_runs_in_flight(fixture_model_dir, monkeypatch):
    import os
    import signal
    import threading
    import nystromformer.glue.sweep as sweep
    started = []
    real_popen = subprocess.Popen

    def long_run(cmd, **kwargs):  # a real child process that would outlive the sweep unless it is stopped
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs))
        return started[-1]
    monkeypatch.setattr(sweep.subprocess, "Popen", long_run)
    runs = grid(["MRPC"], lrs=[1e-3, 2e-3, 3e-3], batch_sizes=[2], checkpoint=0, epochs=1, progress=False)
    threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(SystemExit) as stopped:
        run_sweep(fixture_model_dir, runs, devices=["", ""], log=quiet)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert len(started) == 2  # two devices: the third run never started
    for child in started:
        assert child.wait(timeout=10) == -signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_glue_folder_without_the_tasks_folder_names_the_config_key(fixture_model_dir):
    settings = FinetuneSettings(task="RTE", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    with pytest.raises(UserError, match=r"config.json: glue_dataset_folder: no RTE/ in .*glue"):
        finetune(fixture_model_dir, settings, log=quiet)


def test_a_file_whose_every_row_is_malformed_is_one_error_naming_the_rows(fixture_model_dir, tmp_path):
    glue = tmp_path / "glue"
    shutil.copytree(FIXTURES, glue)
    train = glue / "MRPC" / "train.tsv"
    lines = train.read_text().splitlines()
    train.write_text("\n".join([lines[0]] + [line.rsplit("\t", 1)[0] for line in lines[1:]]) + "\n")
    config = json.loads((fixture_model_dir / "config.json").read_text())
    config["glue_dataset_folder"] = str(glue)
    (fixture_model_dir / "config.json").write_text(json.dumps(config))
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    messages = []
    with pytest.raises(UserError, match=r"train.tsv: skipped \d+ malformed row\(s\): train.tsv:2: 4 fields"):
        finetune(fixture_model_dir, settings, log=messages.append)
    assert not any(m.startswith("warning:") for m in messages)


def test_a_sweep_over_a_task_whose_folder_is_missing_stops_before_the_first_run(fixture_model_dir):
    runs = grid(["MRPC", "RTE"], lrs=[1e-3], batch_sizes=[2], checkpoint=0, epochs=1, progress=False)
    with pytest.raises(UserError, match=r"glue_dataset_folder: no RTE/ in .*; or leave RTE out of --tasks"):
        run_sweep(fixture_model_dir, runs, log=quiet)
    assert not (fixture_model_dir / "model" / "glue").exists()
    # several missing: all named in one error, not one per rerun
    runs = grid(["MRPC", "RTE", "SST-2", "CoLA"], lrs=[1e-3], batch_sizes=[2], checkpoint=0, epochs=1, progress=False)
    with pytest.raises(UserError, match=r"glue_dataset_folder: no RTE/, SST-2/, CoLA/ in .*; or leave RTE, SST-2, CoLA "
                                        r"out of --tasks"):
        run_sweep(fixture_model_dir, runs, log=quiet)


def test_a_malformed_grid_value_is_named_with_its_flag(fixture_model_dir, capsys):
    from nystromformer.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["glue-sweep", "--model-dir", str(fixture_model_dir), "--checkpoint", "0", "--lrs", "2e-5,abc"])
    assert exit_.value.code == 2
    assert "argument --lrs: expected comma-separated numbers, got '2e-5,abc'" in capsys.readouterr().err


def test_the_best_epoch_is_the_one_with_the_best_dev_score_and_a_nan_score_never_wins():
    from nystromformer.glue.metrics import better_score
    nan = float("nan")
    assert better_score(0.6, 0.5) and not better_score(0.4, 0.5)
    assert not better_score(0.5, 0.5)                    # a tie keeps the earlier epoch
    assert better_score(0.5, nan) and better_score(-1.0, nan)  # a finite epoch beats a diverged one
    assert not better_score(nan, 0.5) and not better_score(nan, nan)


def test_the_submission_is_predicted_with_the_best_epochs_weights_not_the_last(fixture_model_dir, monkeypatch):
    from nystromformer.glue import finetune as ft
    real_evaluate, scores, evaluated = ft.evaluate, iter([0.9, 0.1]), []  # epoch 1 scores best, the last worse

    def evaluate(runner, *args):
        evaluated.append({name: t.clone() for name, t in runner.model.state_dict().items()})
        metrics, one_class = real_evaluate(runner, *args)
        score = next(scores)
        return {name: score for name in metrics}, one_class

    predicted_with = {}
    real_submit = ft.write_task_submission

    def write_task_submission(runner, *args, **kwargs):
        predicted_with.update({name: t.clone() for name, t in runner.model.state_dict().items()})
        return real_submit(runner, *args, **kwargs)

    monkeypatch.setattr(ft, "evaluate", evaluate)
    monkeypatch.setattr(ft, "write_task_submission", write_task_submission)
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-2, batch_size=1, epochs=2, progress=False)
    result = finetune(fixture_model_dir, settings, log=quiet)
    assert result["best_epoch"] == 1 and [h["score"] for h in result["history"]] == [0.9, 0.1]
    best = torch.load(run_dir(fixture_model_dir / "model", settings) / "best.model", weights_only=True)
    assert best["epoch"] == 1 and predicted_with.keys() == best["model_state_dict"].keys()
    assert all(torch.equal(predicted_with[name], t) for name, t in best["model_state_dict"].items())
    assert all(torch.equal(evaluated[0][name], t) for name, t in best["model_state_dict"].items())
    # The last epoch's weights differ (lr 1e-2): predicting with them would be the mistake this guards against.
    assert any(not torch.equal(evaluated[1][name], t) for name, t in best["model_state_dict"].items())


def test_warmup_is_a_fraction_of_all_steps_and_the_rate_decays_to_zero_at_the_end(fixture_model_dir):
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=1, epochs=2, warmup=0.5,
                                progress=False, submission=False)
    history = finetune(fixture_model_dir, settings, log=quiet)["history"]
    # 3 steps an epoch, 6 in all, 3 warming up: the peak is reached at the end of the first epoch.
    assert [h["lr"] for h in history] == [pytest.approx(1e-3), pytest.approx(0.0)]


def test_a_warmup_of_a_fractional_number_of_steps_is_rounded_down(fixture_model_dir):
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=1, epochs=2, warmup=0.25,
                                progress=False, submission=False)
    history = finetune(fixture_model_dir, settings, log=quiet)["history"]
    # 6 steps, 0.25 of them is 1.5: 1 step of warm-up, then 5 of decay; after step 3, (6 - 3) / 5 of the peak.
    assert [h["lr"] for h in history] == [pytest.approx(0.6e-3), pytest.approx(0.0)]


def test_training_subsets_do_not_depend_on_the_global_random_state():
    from nystromformer.glue.finetune import subsample
    from nystromformer.glue.tasks import Example
    import random
    examples = [Example(str(i), "a", None, i % 2) for i in range(100)]
    random.seed(1)
    first = subsample(examples, 10)
    random.seed(2)
    assert subsample(examples, 10) == first and len(first) == 10
    assert [e.index for e in first] == sorted((e.index for e in first), key=int)  # file order kept


def test_max_train_examples_limits_the_training_set_only(fixture_model_dir):
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=8, epochs=1, progress=False,
                                submission=False, max_train_examples=1)
    messages = []
    finetune(fixture_model_dir, settings, log=messages.append)
    assert any("on MRPC: 1 train example, 2 dev examples, 1 step on cpu;" in m for m in messages), messages


def test_test_outputs_that_are_not_finite_write_no_submission_file_and_are_recorded(fixture_model_dir, monkeypatch):
    from nystromformer.glue import finetune as ft
    real_submit = ft.write_task_submission

    def with_one_nan_row(runner, *args, **kwargs):  # finite on dev, one NaN row on test
        predict = runner.predict

        def predict_with_nan(loader):
            outputs = predict(loader).copy()
            outputs[0] = np.nan
            return outputs
        runner.predict = predict_with_nan
        return real_submit(runner, *args, **kwargs)

    monkeypatch.setattr(ft, "write_task_submission", with_one_nan_row)
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    message = "MRPC.tsv: the model's outputs are NaN or infinite for 1 of 2 test rows"
    with pytest.raises(ft.SubmissionError, match=message):
        finetune(fixture_model_dir, settings, log=quiet)
    out = run_dir(fixture_model_dir / "model", settings)
    assert not (out / "submission" / "MRPC.tsv").exists()
    assert [e.startswith(message) for e in json.loads((out / "result.json").read_text())["submission_errors"]] == [True]


def test_the_sweep_average_is_over_the_best_run_of_each_task(tmp_path):
    runs = grid(["RTE", "MRPC"], lrs=[1e-3, 2e-3], batch_sizes=[2], checkpoint=0, epochs=2)
    scores = {("RTE", 1e-3): 0.5, ("RTE", 2e-3): 0.6, ("MRPC", 1e-3): 0.9, ("MRPC", 2e-3): 0.7}
    for settings in runs:
        write_finished_run(tmp_path, settings, scores[settings.task, settings.lr])
    summary = write_summary(tmp_path, runs, log=quiet)
    assert {t: r["score"] for t, r in summary["best_per_task"].items()} == {"MRPC": 0.9, "RTE": 0.6}
    assert summary["average"] == pytest.approx(0.75)  # not 0.675, the mean of every run


def test_submission_rows_carry_the_test_files_own_indices(shared_dir, tmp_path):
    glue = tmp_path / "glue"
    shutil.copytree(FIXTURES / "MRPC", glue / "MRPC")
    test_file = glue / "MRPC" / "test.tsv"
    header, *rows = test_file.read_text().splitlines()
    test_file.write_text("\n".join([header] + [f"{10 * (i + 1)}\t{row.split(chr(9), 1)[1]}"
                                               for i, row in enumerate(rows)]) + "\n")
    model_dir = make_model_folder(tmp_path / "tiny", shared_dir / "tokenizers" / "roberta-base", glue)
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False)
    finetune(model_dir, settings, log=quiet)
    submitted = read_submission(run_dir(model_dir / "model", settings) / "submission" / "MRPC.tsv")
    assert [index for index, _ in submitted] == ["10", "20"]


def test_fine_tuning_decays_matrices_only_with_the_adamw_settings_of_roberta():
    from nystromformer.glue.finetune import build_optimizer
    model = NystromformerForSequenceClassification(ModelConfig(
        vocab_size=64, max_seq_len=32, embedding_dim=32, transformer_dim=32, transformer_hidden_dim=64,
        num_layers=1, num_head=4, head_dim=8, num_landmarks=8), num_labels=2)
    optimizer = build_optimizer(model, 1e-3, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in optimizer.param_groups}
    assert set(groups) == {0.05, 0.0} and groups[0.05] | groups[0.0] == set(names.values())
    assert all(n.endswith("weight") and "norm" not in n for n in groups[0.05])       # the matrices
    assert all(n.endswith("bias") or "norm" in n for n in groups[0.0])               # biases and LayerNorms
    assert all((g["lr"], g["betas"], g["eps"]) == (1e-3, (0.9, 0.98), 1e-6) for g in optimizer.param_groups)


def test_inputs_are_truncated_to_max_seq_len_and_each_epoch_reshuffles_by_the_seed(fixture_model_dir,
                                                                                     monkeypatch):
    from nystromformer.glue.encoding import PadCollator
    batches, collate = [], PadCollator.__call__

    def record(self, examples):
        batch = collate(self, examples)
        batches.append(batch["input_ids"])
        return batch

    monkeypatch.setattr(PadCollator, "__call__", record)
    orders = {}
    for seed in (1, 1, 2):
        batches.clear()
        settings = FinetuneSettings(task="QNLI", checkpoint=0, lr=1e-3, batch_size=1, epochs=2, seed=seed,
                                    max_seq_len=12, progress=False, submission=False)
        shutil.rmtree(run_dir(fixture_model_dir / "model", settings), ignore_errors=True)  # trained again
        finetune(fixture_model_dir, settings, log=quiet)
        assert max(b.shape[1] for b in batches) == 12  # the fixture's pairs are longer
        train = [tuple(b[0].tolist()) for b in batches if b.shape[0] == 1]
        n = len(train) // 2
        orders.setdefault(seed, []).append((train[:n], train[n:]))
    (first, second), again = orders[1]
    assert first != second and sorted(first) == sorted(second)  # a new order each epoch, the same examples
    assert again == (first, second) and orders[2][0] != (first, second)  # the seed fixes it


def test_a_collected_submission_file_goes_when_its_run_is_no_longer_the_best_and_the_new_best_has_none(tmp_path):
    # submission is not a compared setting: a --no-submission run of the same grid can become the best
    runs = grid(["MRPC"], lrs=[1e-3, 2e-3], batch_sizes=[2], checkpoint=0, epochs=2)
    write_finished_run(tmp_path, runs[0], 0.5)
    first = run_dir(tmp_path, runs[0])
    (first / "submission").mkdir()
    (first / "submission" / "MRPC.tsv").write_text("index\tprediction\n0\t1\n")
    result = json.loads((first / "result.json").read_text())
    (first / "result.json").write_text(json.dumps({**result, "submission": ["submission/MRPC.tsv"]}))
    collected = Path(write_summary(tmp_path, runs, log=quiet)["dir"]) / "submission" / "MRPC.tsv"
    assert collected.read_text() == "index\tprediction\n0\t1\n"
    write_finished_run(tmp_path, dataclasses.replace(runs[1], submission=False), 0.7)
    messages = []
    summary = write_summary(tmp_path, runs, log=messages.append)
    assert summary["best_per_task"]["MRPC"]["score"] == 0.7 and len(summary["rows"]) == 2
    assert not any(m.startswith("warning:") for m in messages), messages
    assert not collected.exists()
    assert "missing MRPC.tsv (MRPC's best run MRPC-0-0.002-2-2: made with --no-submission)" in \
        Path(summary["markdown"]).read_text()


def test_a_parallel_sweep_gives_each_run_a_free_device_and_reports_every_failed_run(fixture_model_dir, monkeypatch):
    import threading
    import nystromformer.glue.sweep as sweep
    real_popen, running, reused_busy = subprocess.Popen, {}, []

    def failing_run(cmd, env, **kwargs):  # a real child on its device, failing as a crashed run would
        device = env["CUDA_VISIBLE_DEVICES"]
        reused_busy.append(device in running and running[device].poll() is None)
        running[device] = real_popen([sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"],
                                     env=env, **kwargs)
        return running[device]

    monkeypatch.setattr(sweep.subprocess, "Popen", failing_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPUs "a" and "b", as the children are told
    runs = grid(["MRPC"], lrs=[1e-3, 2e-3, 3e-3], batch_sizes=[2], checkpoint=0, epochs=1, progress=False)
    messages, outcome = [], {}
    worker = threading.Thread(target=lambda: outcome.update(run_sweep(fixture_model_dir, runs, devices=["a", "b"],
                                                                      log=messages.append)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "three runs on two devices never finished: a device was not given back"
    assert sorted(running) == ["a", "b"] and reused_busy == [False, False, False]
    assert sorted(outcome["failed"]) == sorted(s.run_name for s in runs)
    assert sum(m.startswith("FAILED MRPC-0-") and "(exit 3); see" in m for m in messages) == 3, messages


def test_a_sweep_given_one_device_runs_every_run_on_it_and_by_default_one_gpu_runs_them_in_process(
        fixture_model_dir, monkeypatch, capsys):
    import torch

    import nystromformer.glue.sweep as sweep
    from nystromformer.cli import main
    real_popen, children = subprocess.Popen, []

    def failing_run(cmd, env, **kwargs):  # a real child, failing at once: the device it was given is what counts
        children.append(env["CUDA_VISIBLE_DEVICES"])
        return real_popen([sys.executable, "-c", "import sys; sys.exit(3)"], env=env, **kwargs)

    monkeypatch.setattr(sweep.subprocess, "Popen", failing_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPU 2, as the children are told
    flags = ["--tasks", "MRPC", "--checkpoint", "0", "--epochs", "1", "--batch-sizes", "2", "--device", "cpu",
             "--max-train-examples", "8", "--max-eval-examples", "8", "--no-progress", "--no-submission",
             "--model-dir", str(fixture_model_dir)]
    # --devices 2: one run at a time, each in a process that sees only that GPU (not this process's --device)
    assert main(["glue-sweep", "--devices", "2", "--lrs", "1e-3,2e-3", *flags]) == 1
    assert children == ["2", "2"]
    assert "running 2 run(s) on CUDA_VISIBLE_DEVICES 2" in capsys.readouterr().out
    # No --devices and one GPU: the runs go in this process, on --device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["glue-sweep", "--lrs", "3e-3", *flags]) == 0
    assert children == ["2", "2"]
    assert (run_dir(fixture_model_dir / "model", grid(["MRPC"], lrs=[3e-3], batch_sizes=[2], checkpoint=0, epochs=1,
                                                      max_train_examples=8, max_eval_examples=8)[0])
            / "result.json").is_file()
    # Two GPUs seen through CUDA_VISIBLE_DEVICES=2,3: the runs go to those two, not to the machine's 0 and 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert main(["glue-sweep", "--lrs", "4e-3,5e-3", *flags]) == 1
    assert sorted(children[2:]) == ["2", "3"]
    # CUDA counts the listed GPUs up to the first one that does not exist: only those get runs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,7")
    assert main(["glue-sweep", "--lrs", "6e-3,7e-3,8e-3", *flags]) == 1
    assert len(children) == 7 and set(children[4:]) == {"2", "3"}
    # entries given with spaces after the commas are the same devices (" 3" would be no device to CUDA)
    assert main(["glue-sweep", "--devices", "2, 3", "--lrs", "9e-3,1e-2", *flags]) == 1
    assert sorted(children[7:]) == ["2", "3"]


def test_a_sweep_asked_for_gpus_on_a_machine_without_one_or_with_a_misspelt_switch_stops_before_its_first_run(
        fixture_model_dir, monkeypatch, capsys):
    # Each run would otherwise train on the CPU under CUDA_VISIBLE_DEVICES=0, or fail at its first forward.
    from nystromformer.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flags = ["--tasks", "MRPC", "--checkpoint", "0", "--epochs", "1", "--batch-sizes", "2", "--lrs", "1e-3,2e-3",
             "--no-progress", "--no-submission", "--model-dir", str(fixture_model_dir)]
    assert main(["glue-sweep", "--devices", "0", *flags]) == 2
    assert "error: --devices 0: PyTorch sees no CUDA GPU here" in capsys.readouterr().err
    monkeypatch.setenv("NYSTROM_TRITON", "bogus")
    assert main(["glue-sweep", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("NYSTROM_TRITON: expected one of 0, 1, all, got 'bogus'") == 1 and "FAILED" not in err
    runs = fixture_model_dir / "model" / "glue"
    assert not runs.exists() or not any(runs.iterdir())


def test_a_tokenizer_whose_files_changed_since_the_pretraining_data_was_built_is_refused(shared_dir, tmp_path):
    # `train-tokenizer --overwrite` into the folder the shards were built with: same path, same size, other ids.
    # meta.json's tokenizer_files_sha256 (what build-shards checks) stops fine-tuning and export before they start.
    from nystromformer.config import ConfigError, load_config
    from nystromformer.interop import export_hf
    from nystromformer.shards import make_meta, write_meta
    from nystromformer.tokenizer import load_tokenizer, special_token_ids, tokenizer_files_digest
    tok = tmp_path / "tok"
    shutil.copytree(shared_dir / "tokenizers" / "roberta-base", tok)
    folder = make_model_folder(tmp_path / "tiny", tok, FIXTURES)
    (folder / "dataset").mkdir()
    loaded = load_tokenizer(tok)
    write_meta(folder / "dataset", make_meta(128, len(loaded), str(tok), special_token_ids(loaded),
                                             tokenizer_files_sha256=tokenizer_files_digest(tok)))
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False,
                                max_train_examples=4, max_eval_examples=4, submission=False)
    finetune(folder, settings, log=quiet)   # the data's own tokenizer: fine
    vocab = json.loads((tok / "vocab.json").read_text())
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]   # two ids swapped, size unchanged
    (tok / "vocab.json").write_text(json.dumps(vocab))
    says = (f"{folder / 'config.json'}: tokenizer: the files in {tok} are not those the pretraining data in "
            f"{folder / 'dataset'} was tokenized with")
    with pytest.raises(ConfigError) as err:
        finetune(folder, dataclasses.replace(settings, lr=2e-3), log=quiet)
    assert str(err.value).startswith(says), str(err.value)
    with pytest.raises(ConfigError) as err:
        export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=quiet)
    assert str(err.value).startswith(says) and not (tmp_path / "hf").exists(), str(err.value)


def test_a_run_made_under_other_model_settings_is_redone_and_settings_other_than_pretrainings_are_named(
        fixture_model_dir):
    # config.json edited after a run (more landmarks, other dropout): its scores are another model's. result.json
    # records the model settings; a sweep redoes the run, saying what changed, and fine-tuning names what differs
    # from the settings the checkpoint was pretrained with (it fine-tunes with config.json's, as asked).
    from nystromformer.config import load_config
    cp = fixture_model_dir / "model" / "cp-0000.model"
    trained = load_config(fixture_model_dir).to_dict()
    atomic.torch_save(cp, {**torch.load(cp, weights_only=True), "config": trained})
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False,
                                max_train_examples=4, max_eval_examples=4, submission=False)
    said = []
    first = finetune(fixture_model_dir, settings, log=said.append)
    assert first["model_settings"]["num_landmarks"] == 8 and not any("pretrained with" in m for m in said), said
    assert run_sweep(fixture_model_dir, [settings], log=quiet)["skipped"] == [settings.run_name]
    config = json.loads((fixture_model_dir / "config.json").read_text())
    other_lr = dataclasses.replace(settings, lr=2e-3)
    finetune(fixture_model_dir, other_lr, log=quiet)
    config["model"].update(num_landmarks=16, dropout_prob=0.1, weight_init="bert")  # a fresh head inits otherwise
    (fixture_model_dir / "config.json").write_text(json.dumps(config))
    said = []
    outcome = run_sweep(fixture_model_dir, [settings], log=said.append)
    assert outcome["ran"] == [settings.run_name], said
    assert any(m.startswith("warning: replacing ") and "model.dropout_prob 0.0 -> 0.1" in m
               and "model.num_landmarks 8 -> 16" in m and 'model.weight_init "paper" -> "bert"' in m
               for m in said), said
    # the other learning rate's run, made under the old settings, is left out of the summary, with that reason
    assert any(other_lr.run_name in m and "config.json's model settings changed since they ran" in m
               and "padded" not in m for m in said), said
    assert any("model settings other than those cp-0000.model was pretrained with (dropout_prob 0.0 -> 0.1, "
               "num_landmarks 8 -> 16); fine-tuning with config.json's" in m for m in said), said
    assert run_sweep(fixture_model_dir, [settings], log=quiet)["skipped"] == [settings.run_name]


def test_a_checkpoint_config_not_as_this_pipeline_writes_it_is_not_compared_and_not_a_traceback(fixture_model_dir):
    cp = fixture_model_dir / "model" / "cp-0000.model"
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False,
                                max_train_examples=4, max_eval_examples=4, submission=False)
    for n, odd in enumerate(({"model": None}, "v1", None)):
        atomic.torch_save(cp, {**torch.load(cp, weights_only=True), "config": odd})
        said = []
        finetune(fixture_model_dir, dataclasses.replace(settings, seed=n), log=said.append)
        assert not any("pretrained with" in m for m in said), said


def test_a_second_fine_tuning_run_of_the_same_name_is_refused_while_the_first_runs(fixture_model_dir):
    # Two `glue` commands with one run name would write one folder (last writer wins, result and weights of
    # different runs); the first holds the run folder's lock, as `pretrain` does its model folder's.
    import fcntl
    import os
    from nystromformer.errors import UserError
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False,
                                max_train_examples=4, max_eval_examples=4, submission=False)
    out = run_dir(fixture_model_dir / "model", settings)
    out.mkdir(parents=True)
    fd = os.open(out / "run.lock", os.O_RDWR | os.O_CREAT)   # the other run, still going
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"gpu-node-7 pid 4242\n")
        with pytest.raises(UserError, match=r"another fine-tuning run with these settings is in progress "
                                            r"\(gpu-node-7 pid 4242 holds .*/run.lock\); wait for it"):
            finetune(fixture_model_dir, settings, log=quiet)
        assert not (out / "result.json").exists()
    finally:
        os.close(fd)   # it ends: the next run goes ahead
    assert finetune(fixture_model_dir, settings, log=quiet)["best_epoch"] == 1


def test_each_sweep_setting_gets_its_own_summary_folder_but_test_predictions_do_not_matter():
    base = FinetuneSettings(task="RTE", checkpoint=3)
    folder = summary_dir(Path("m"), base)
    assert folder == Path("m/glue/sweep-3") and summary_dir(Path("m"), dataclasses.replace(base, submission=False)) \
        == folder
    others = [dataclasses.replace(base, epochs=3), dataclasses.replace(base, epochs=10),
              dataclasses.replace(base, warmup=0.1)]
    assert len({folder, *(summary_dir(Path("m"), s) for s in others)}) == 4


def test_unreadable_or_misnamed_run_folders_are_named_in_warnings_not_summarised_or_fatal(tmp_path):
    runs = grid(["RTE"], lrs=[1e-3], batch_sizes=[2], checkpoint=0, epochs=2)
    write_finished_run(tmp_path, runs[0], 0.5)
    for name, content in (("RTE-torn", '{"settings": {"task": "RTE"'), ("RTE-alien", '{"settings": {"bogus": 1}}')):
        (tmp_path / "glue" / name).mkdir()
        (tmp_path / "glue" / name / "result.json").write_text(content)
    seven = dataclasses.replace(runs[0], seed=7)
    write_finished_run(tmp_path, seven, 0.9)
    (tmp_path / "glue" / seven.run_name).rename(tmp_path / "glue" / "RTE-renamed")
    messages = []
    assert [r["score"] for r in write_summary(tmp_path, runs, log=messages.append)["rows"]] == [0.5]
    warnings = "\n".join(m for m in messages if m.startswith("warning:"))
    assert "RTE-torn/result.json is unreadable (JSONDecodeError" in warnings
    assert "RTE-alien/result.json is unreadable (TypeError" in warnings
    summary7 = []
    assert write_summary(tmp_path, [seven], log=summary7.append)["rows"] == []
    assert any(f"RTE-renamed holds run {seven.run_name}; not in the summary" in m for m in summary7), summary7


def test_each_epochs_train_loss_is_the_mean_of_that_epochs_batch_losses(fixture_model_dir, monkeypatch):
    # MRPC's 3 training examples in batches of 2: two batches an epoch (the second of one example), two epochs.
    batch_losses = []
    real_loss = NystromformerForSequenceClassification.loss

    def recording_loss(self, logits, labels):  # the real loss, noted as the training loop reads it
        loss = real_loss(self, logits, labels)
        batch_losses.append(loss.item())
        return loss

    monkeypatch.setattr(NystromformerForSequenceClassification, "loss", recording_loss)
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-2, batch_size=2, epochs=2, progress=False,
                                submission=False)
    messages = []
    history = finetune(fixture_model_dir, settings, log=messages.append)["history"]
    assert len(batch_losses) == 4 and len(set(batch_losses)) == 4  # each batch's loss differs from the others
    per_epoch = [batch_losses[0:2], batch_losses[2:4]]
    expected = [sum(losses) / len(losses) for losses in per_epoch]  # the mean over the epoch's batches, no other
    assert [h["train_loss"] for h in history] == pytest.approx(expected, rel=1e-9, abs=0)
    logged = [json.loads(line)["train_loss"] for line in
              log_path(fixture_model_dir / "model", settings).read_text().splitlines()]
    assert logged == [h["train_loss"] for h in history]
    for epoch, mean in enumerate(expected, 1):
        assert any(m.startswith(f"MRPC epoch {epoch}/2: train loss {mean:.4f}, dev ") for m in messages), messages


def test_dev_outputs_that_are_partly_not_finite_make_that_splits_metrics_nan_not_an_argmax_of_nan(shared_dir):
    # One diverged row among finite ones: argmax would read its NaN logits as class 0 and give a plausible accuracy.
    from nystromformer.glue.encoding import EncodedDataset, PadCollator
    from nystromformer.glue.finetune import Runner, evaluate
    from nystromformer.glue.metrics import better_score, split_metrics, task_score
    from nystromformer.glue.tasks import TASKS, Example
    from nystromformer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(shared_dir / "tokenizers" / "roberta-base")
    model = _tiny_classifier(tokenizer, 3)
    matched = [Example("0", "a cat sat", "on the mat", 0), Example("1", "a dog ran", "in the park", 1),
               Example("2", "a zebra grazed", "in the park", 2), Example("3", "the cat ran", "on the mat", 0)]
    mismatched = [Example("0", "a dog sat", "in the park", 1), Example("1", "the cat sat", "on the mat", 2)]
    ids = lambda e: set(tokenizer(e.text_a, e.text_b)["input_ids"])  # noqa: E731
    zebra = ids(matched[2]) - set().union(*(ids(e) for e in matched[:2] + matched[3:] + mismatched))
    with torch.no_grad():  # the word only example 2 of matched has: its embedding diverged
        model.encoder.embeddings.word_embeddings.weight[sorted(zebra)] = float("nan")
    collate = PadCollator(tokenizer.pad_token_id, False)
    # One row a batch: the authors' pseudo-inverse init takes its scale over the whole batch, so a NaN row spreads to
    # its batch mates (nystrom.iterative_pinv); here the other rows stay finite.
    loaders = {split: DataLoader(EncodedDataset(ex, tokenizer, 32, False), batch_size=1, collate_fn=collate)
               for split, ex in (("matched", matched), ("mismatched", mismatched))}
    runner = Runner(model, torch.device("cpu"), False)
    outputs = runner.predict(loaders["matched"])
    assert np.isnan(outputs).any(axis=1).tolist() == [False, False, True, False]  # partly, not all
    finite = runner.predict(loaders["mismatched"])

    labels = {"matched": [e.label for e in matched], "mismatched": [e.label for e in mismatched]}
    metrics, one_class = evaluate(runner, TASKS["MNLI"], loaders, labels)
    assert math.isnan(metrics["accuracy_matched"])
    assert metrics["accuracy_mismatched"] == split_metrics("MNLI", finite.argmax(-1), labels["mismatched"])["accuracy"]
    assert "matched" not in one_class
    assert math.isnan(task_score(metrics)) and not better_score(task_score(metrics), 0.0)  # never the best epoch


def test_a_model_predicting_one_class_for_a_whole_dev_split_is_warned_about_by_task_epoch_and_split(
        shared_dir, tmp_path):
    # MNLI's matched dev rows made identical (their labels differ): any model predicts one class for all of them.
    # Mismatched keeps one row: a single prediction is no sign of a degenerate classifier.
    glue = tmp_path / "glue"
    shutil.copytree(FIXTURES / "MNLI", glue / "MNLI")
    header, first, *rest = (glue / "MNLI" / "dev_matched.tsv").read_text().splitlines()
    copies = [first.split("\t") for _ in range(3)]
    for i, (row, label) in enumerate(zip(copies, ["neutral", "entailment", "contradiction"])):
        row[0], row[-1] = str(i), label
    (glue / "MNLI" / "dev_matched.tsv").write_text("\n".join([header] + ["\t".join(r) for r in copies]) + "\n")
    header, first, *rest = (glue / "MNLI" / "dev_mismatched.tsv").read_text().splitlines()
    (glue / "MNLI" / "dev_mismatched.tsv").write_text(f"{header}\n{first}\n")
    model_dir = make_model_folder(tmp_path / "tiny", shared_dir / "tokenizers" / "roberta-base", glue)

    settings = FinetuneSettings(task="MNLI", checkpoint=0, lr=1e-3, batch_size=2, epochs=2, progress=False,
                                submission=False)
    messages = []
    finetune(model_dir, settings, log=messages.append)
    warnings = [m for m in messages if "one class" in m]
    assert warnings == [f"warning: MNLI epoch {epoch}: the model predicts one class for every matched example (a "
                        f"degenerate classifier: try another learning rate or more epochs)" for epoch in (1, 2)]


def test_a_classifier_whose_dev_predictions_differ_is_not_reported_as_predicting_one_class(shared_dir):
    from nystromformer.glue.encoding import EncodedDataset, PadCollator
    from nystromformer.glue.finetune import Runner, evaluate
    from nystromformer.glue.tasks import TASKS, Example
    from nystromformer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(shared_dir / "tokenizers" / "roberta-base")
    model = _tiny_classifier(tokenizer, 2)
    words = ["cat", "dog", "zebra", "house", "river", "green", "seven", "music"]
    dev = [Example(str(i), f"the {w} is here", "another one", i % 2) for i, w in enumerate(words)]
    loader = DataLoader(EncodedDataset(dev, tokenizer, 32, False), batch_size=4,
                        collate_fn=PadCollator(tokenizer.pad_token_id, False))
    runner = Runner(model, torch.device("cpu"), False)
    outputs = runner.predict(loader)
    with torch.no_grad():  # the decision threshold moved to the median margin: half the examples in each class
        model.classifier.out_proj.bias[1] -= float(np.median(outputs[:, 1] - outputs[:, 0]))
    predictions = runner.predict(loader).argmax(-1)
    assert sorted(predictions.tolist()) == [0] * 4 + [1] * 4, predictions
    _, one_class = evaluate(runner, TASKS["RTE"], {"dev": loader}, {"dev": [e.label for e in dev]})
    assert one_class == []


def test_a_longer_max_seq_len_that_is_not_a_whole_multiple_of_the_models_is_refused_before_training(
        fixture_model_dir):
    # The position embeddings are tiled to a longer length, which needs a whole multiple (the model's is 128);
    # the refusal names the flag, and comes before any data is read or a run folder made.
    settings = FinetuneSettings(task="MRPC", checkpoint=0, max_seq_len=192, progress=False, submission=False)
    with pytest.raises(SettingsError, match=r"^--max-seq-len: 192 is longer than the model's max_seq_len 128 but not "
                                            r"a whole multiple of it; tiling the position embeddings needs one "
                                            r"\(e.g. 256\)$"):
        finetune(fixture_model_dir, settings, log=lambda m: None)
    assert not run_dir(fixture_model_dir / "model", settings).exists()
    history = finetune(fixture_model_dir, dataclasses.replace(settings, max_seq_len=256, epochs=1),
                       log=lambda m: None)["history"]
    assert len(history) == 1


def test_a_model_folder_fine_tuning_cannot_write_to_is_refused_before_training(fixture_model_dir, monkeypatch):
    import os

    from nystromformer.glue import finetune as finetune_module
    folder = fixture_model_dir / "model"
    access = os.access  # the root user passes permission checks: the file system's answer is stood in for here
    monkeypatch.setattr(finetune_module.atomic.os, "access",
                        lambda p, mode: False if Path(p) == folder else access(p, mode))
    settings = FinetuneSettings(task="MRPC", checkpoint=0, epochs=1, progress=False)
    with pytest.raises(UserError, match=f"^the run's results cannot be written to {run_dir(folder, settings)}: "
                                        f"{folder} is not writable"):
        finetune(fixture_model_dir, settings, log=quiet)
    assert not (folder / "glue").exists()  # no log line, no weights: training never started


def test_a_tokenizer_that_is_not_the_models_is_refused_or_warned_about(fixture_model_dir):
    from nystromformer import shards
    from nystromformer.config import ConfigError
    config_file = fixture_model_dir / "config.json"
    config = json.loads(config_file.read_text())
    settings = FinetuneSettings(task="MRPC", checkpoint=0, epochs=1, progress=False, submission=False,
                                max_train_examples=8, max_eval_examples=8)
    # More tokens than the model's embedding table: ids past its end, refused before anything is read
    config_file.write_text(json.dumps({**config, "model": {**config["model"], "vocab_size": 1000}}))
    with pytest.raises(ConfigError, match=r"config.json: tokenizer: 50265 tokens, more than model.vocab_size \(1000\): "
                                          r"not the tokenizer this model was pretrained with"):
        finetune(fixture_model_dir, settings, log=quiet)
    assert not (fixture_model_dir / "model" / "glue").exists()
    # Fewer than the pretraining data's vocabulary: the ids would mean other words; said, as the run goes on
    config_file.write_text(json.dumps(config))
    special = {"bos": 0, "pad": 1, "eos": 2, "unk": 3, "mask": 50264}
    shards.write_meta(fixture_model_dir / "dataset", shards.make_meta(128, 50266, "other-bpe", special))
    messages = []
    finetune(fixture_model_dir, settings, log=messages.append)
    assert (f"warning: {config_file}: tokenizer: 50265 tokens, but the pretraining data in "
            f"{fixture_model_dir / 'dataset'} has a 50266-token vocabulary") in "\n".join(messages)


def test_a_tokenizer_that_cannot_be_found_is_an_error_naming_the_config_key(fixture_model_dir, capsys):
    config_file = fixture_model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "tokenizer": "no-such-tokenizer"}))
    assert run_glue_main(["--model-dir", str(fixture_model_dir), "--task", "MRPC", "--checkpoint", "0"]) == 2
    err = capsys.readouterr().err
    named = fixture_model_dir / "no-such-tokenizer"
    assert err == f"error: {config_file}: tokenizer: tokenizer '{named}': no such folder\n", err


def test_an_in_process_sweep_reports_a_users_mistake_in_one_line_and_a_bug_with_its_traceback(
        fixture_model_dir, monkeypatch):
    import nystromformer.glue.sweep as sweep
    from nystromformer.errors import UserError
    outcomes = iter([UserError("RTE: no train.tsv in glue/RTE"), AttributeError("'NoneType' has no attribute 'x'")])

    def finetune(model_dir, settings, log):
        raise next(outcomes)
    monkeypatch.setattr(sweep, "finetune", finetune)
    runs = grid(["MRPC"], lrs=[1e-3, 2e-3], batch_sizes=[2], checkpoint=0, epochs=1, progress=False)
    messages = []
    outcome = run_sweep(fixture_model_dir, runs, log=messages.append)
    assert sorted(outcome["failed"]) == sorted(s.run_name for s in runs)
    failed = [m for m in messages if m.startswith("FAILED")]
    assert failed[0] == f"FAILED {runs[0].run_name}: RTE: no train.tsv in glue/RTE"
    assert failed[1].startswith(f"FAILED {runs[1].run_name}: AttributeError") and "Traceback" in failed[1]


def test_the_sweep_plot_marks_whole_epochs_even_for_a_one_epoch_sweep(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import nystromformer.glue.sweep as sweep
    made, subplots = [], plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: made.append(subplots(*a, **k)) or made[-1])
    one = FinetuneSettings(task="RTE", checkpoint=0, lr=1e-4, batch_size=32, epochs=1)
    three = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-4, batch_size=32, epochs=3)
    sweep._plot_dev_scores([(one, {"history": [{"epoch": 1, "score": 0.5}]}),
                            (three, {"history": [{"epoch": e, "score": 0.6} for e in (1, 2, 3)]})],
                           tmp_path / "dev_scores.png")
    mrpc, rte = made[0][1][0]   # in GLUE's task order
    assert list(rte.get_xticks()) == [1] and list(mrpc.get_xticks()) == [1, 2, 3]
    assert (tmp_path / "dev_scores.png").stat().st_size > 0


def test_a_run_recorded_before_its_model_settings_or_one_of_their_keys_counts_as_made_with_todays():
    # Runs before 2026-11-25 recorded no model settings, and a key added since is missing from older records: taken
    # as today's (else every such finished run would be redone); a recorded value that differs is named.
    from nystromformer.glue.finetune import method_differences, method_of, model_settings
    model = ModelConfig()
    method = method_of(model)
    made = {"padding": method["padding"], "evaluation": method["evaluation"]}
    assert method_differences(method, made) == []
    older = {k: v for k, v in model_settings(model).items() if k != "weight_init"}
    assert method_differences(method, {**made, "model_settings": older}) == []
    assert method_differences(method, {**made, "model_settings": {**older, "num_landmarks": 32}}) == [
        "model.num_landmarks 32 -> 64"]


def test_a_run_repeated_with_its_seed_repeats_its_scores_whatever_ran_before_it(fixture_model_dir):
    # The seed fixes the new head's initial weights and the dropout draws, not only the batches' order.
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=2, epochs=1, progress=False,
                                submission=False)
    first = finetune(fixture_model_dir, settings, log=quiet)
    shutil.rmtree(run_dir(fixture_model_dir / "model", settings))  # trained again
    torch.manual_seed(123)
    again = finetune(fixture_model_dir, settings, log=quiet)
    assert [(h["train_loss"], h["dev"]) for h in again["history"]] == [(h["train_loss"], h["dev"])
                                                                       for h in first["history"]]


def test_runs_of_another_summary_folder_are_left_out_of_a_summary_without_a_warning(tmp_path):
    # A training subset (or another seed) has its own summary folder: its runs are not "made with other settings".
    (run,) = grid(["RTE"], lrs=[1e-3], batch_sizes=[2], checkpoint=0, epochs=2)
    write_finished_run(tmp_path, run, 0.5)
    write_finished_run(tmp_path, dataclasses.replace(run, max_train_examples=100), 0.9)
    write_finished_run(tmp_path, dataclasses.replace(run, seed=7), 0.8)
    messages = []
    summary = write_summary(tmp_path, [run], log=messages.append)
    assert [r["score"] for r in summary["rows"]] == [0.5]
    assert not any(m.startswith("warning:") for m in messages), messages
