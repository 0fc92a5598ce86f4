"""Fine-tuning end to end on CPU: a tiny random-init "pretrained" checkpoint, the roberta tokenizer from
../shared, real SST-2 / STS-B subsets and our MNLI fixtures; sweeps; the command-line entry points."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nystromformer import atomic
from nystromformer.config import ModelConfig
from nystromformer.glue.commands import main as run_glue_main, settings_to_argv, settings_from_args
from nystromformer.glue.finetune import FinetuneSettings, finetune, log_path, run_dir
from nystromformer.glue.submission import read_submission
from nystromformer.glue.sweep import grid, run_sweep
from nystromformer.model import NystromformerForMaskedLM

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
    assert log_path(ckpt, settings).name == "glue-SST-2-0-0.003-32-4.log"   # the paper's log name

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
    assert set(result["best_metrics"]) == {"accuracy", "f1"}
    assert len(read_submission(run_dir(fixture_model_dir / "model", settings) / "submission" / "QQP.tsv")) == 3


def test_sweep_writes_a_summary_and_skips_finished_runs_when_rerun(fixture_model_dir):
    runs = grid(["MRPC"], lrs=[1e-3, 2e-3], batch_sizes=[2], checkpoint=0, epochs=2, progress=False)
    first = run_sweep(fixture_model_dir, runs, log=quiet)
    assert first["ran"] == ["MRPC-0-0.001-2-2", "MRPC-0-0.002-2-2"] and first["skipped"] == []
    summary = first["summary"]
    csv_lines = Path(summary["csv"]).read_text().splitlines()
    assert csv_lines[0] == "task,checkpoint,lr,batch_size,epochs,best_epoch,score,accuracy,f1"
    assert len(csv_lines) == 3
    best = max(summary["rows"], key=lambda r: r["score"])
    assert summary["best_per_task"] == {"MRPC": best} and summary["glue_average"] == best["score"]
    assert "GLUE average" in Path(summary["markdown"]).read_text()
    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A third configuration: only it runs; the finished two are skipped.
    more = runs + grid(["MRPC"], lrs=[3e-3], batch_sizes=[2], checkpoint=0, epochs=2, progress=False)
    second = run_sweep(fixture_model_dir, more, log=quiet)
    assert second["skipped"] == ["MRPC-0-0.001-2-2", "MRPC-0-0.002-2-2"] and second["ran"] == ["MRPC-0-0.003-2-2"]
    assert len(Path(second["summary"]["csv"]).read_text().splitlines()) == 4


def test_settings_survive_the_round_trip_through_command_line_flags():
    import argparse
    from nystromformer.glue.commands import add_glue_arguments

    parser = argparse.ArgumentParser()
    add_glue_arguments(parser)
    settings = FinetuneSettings(task="RTE", checkpoint=3, lr=3e-5, batch_size=16, epochs=5, seed=7, max_seq_len=256,
                                max_train_examples=100, submission=False, progress=False)
    assert settings_from_args(parser.parse_args(settings_to_argv(settings))) == settings


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
        assert (out / "result.json").is_file() and (out / "console.txt").is_file()
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
