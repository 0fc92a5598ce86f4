"""Pretraining: learning, exact resume, checkpoint fallback, from_cp warm starts, DDP equivalence."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nystromformer import checkpoint
from nystromformer.config import ConfigError, load_config
from nystromformer.mlm import generator, mask_tokens
from nystromformer.model import IGNORE_INDEX, NystromformerForMaskedLM
from nystromformer.pretrain import PREEMPTED_EXIT_CODE, pretrain

from helpers import SPECIAL, read_log, tiny_config, write_model_dir, write_synthetic_data

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def data(tmp_path):
    return write_synthetic_data(tmp_path / "data")


def model_dir(tmp_path, name="run", **changes):
    cfg = tiny_config()
    for section, values in changes.items():
        if isinstance(values, dict):
            cfg[section].update(values)
        else:
            cfg[section] = values
    return write_model_dir(tmp_path / name, cfg)


def run(folder, **kw):
    return pretrain(load_config(folder), show_progress=False, **kw)


def losses(folder, kind="train"):
    return [(e["step"], e["loss"]) for e in read_log(folder / "model" / "pretrain_output.log", kind)]


def test_masking_follows_80_10_10_and_never_touches_special_tokens():
    ids = torch.randint(5, 1000, (200, 128))
    ids[:, 0], ids[:, -1], ids[:3, 60:] = SPECIAL["bos"], SPECIAL["eos"], SPECIAL["pad"]
    inputs, labels = mask_tokens(ids, generator(0, 1, 7), 0.15, SPECIAL, 1000)
    chosen = labels != IGNORE_INDEX
    special = (ids == SPECIAL["bos"]) | (ids == SPECIAL["eos"]) | (ids == SPECIAL["pad"])
    assert not (chosen & special).any()
    assert abs(chosen.float().sum() / (~special).sum() - 0.15) < 0.01
    masked = (inputs == SPECIAL["mask"]) & chosen
    kept = (inputs == ids) & chosen
    assert abs(masked.sum() / chosen.sum() - 0.8) < 0.02
    assert abs(kept.sum() / chosen.sum() - 0.1) < 0.02  # ~10% unchanged (+ rare random self-hits)
    assert torch.equal(labels[chosen], ids[chosen])
    again, _ = mask_tokens(ids, generator(0, 1, 7), 0.15, SPECIAL, 1000)
    assert torch.equal(inputs, again)


def test_mlm_loss_falls_on_a_learnable_corpus(tmp_path, data):
    folder = model_dir(tmp_path, model={"dropout_prob": 0.0},
                       pretraining_setting={"batches_per_epoch": 50, "epoch": 3, "learning_rate": 3e-3})
    assert run(folder) == 0
    dev = read_log(folder / "model" / "pretrain_output.log", "dev")
    assert dev[-1]["loss"] < dev[0]["loss"] - 0.5
    assert dev[-1]["mlm_accu"] > 0.2  # chance is 1/59
    assert sorted(p.name for p in (folder / "model").glob("cp-*")) == [
        f"cp-{e:04d}.{ext}" for e in range(3) for ext in ("cp", "model")]


@pytest.mark.parametrize("attn_type", ["softmax", "nystrom"])
def test_both_attention_types_pretrain(tmp_path, data, attn_type):
    folder = model_dir(tmp_path, model={"attn_type": attn_type}, pretraining_setting={"epoch": 1})
    assert run(folder) == 0
    assert len(losses(folder)) == 4


def test_compiled_encoder_trains_as_the_eager_one_and_saves_the_same_checkpoint_keys(tmp_path, data, monkeypatch):
    # gpu_setting.compile (CUDA graphs with "reduce-overhead" on a GPU; inductor's CPU code here). One compile
    # thread: no pool of compile workers left running beside the later tests on a 2-core machine.
    import torch._inductor.config
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    runs = {}
    for mode in ("none", "default"):
        folder = model_dir(tmp_path, mode, model={"dropout_prob": 0.0}, pretraining_setting={"epoch": 1},
                           gpu_setting={"inst_per_gpu": 8, "compile": mode})
        assert run(folder) == 0
        state = checkpoint.load(folder / "model" / "cp-0000.model")
        runs[mode] = losses(folder), losses(folder, "dev"), sorted(state["model_state_dict"])
    (eager, eager_dev, eager_keys), (compiled, compiled_dev, compiled_keys) = runs["none"], runs["default"]
    assert compiled_keys == eager_keys
    assert [s for s, _ in compiled] == [s for s, _ in eager]
    assert [loss for _, loss in compiled + compiled_dev] == pytest.approx([loss for _, loss in eager + eager_dev],
                                                                        rel=1e-4)


@pytest.fixture
def uninterrupted(tmp_path, data):
    folder = model_dir(tmp_path, "uninterrupted")
    assert run(folder) == 0
    return losses(folder), losses(folder, "dev")


@pytest.mark.parametrize("stop_at", [4, 6])  # between epochs, and mid-epoch
def test_resume_after_preemption_reproduces_the_uninterrupted_losses(tmp_path, uninterrupted, stop_at):
    folder = model_dir(tmp_path)
    assert run(folder, stop_at_step=stop_at) == PREEMPTED_EXIT_CODE
    assert [s for s, _ in losses(folder)] == list(range(1, stop_at + 1))
    assert run(folder) == 0
    assert losses(folder) == uninterrupted[0]
    assert losses(folder, "dev") == uninterrupted[1]


def test_resume_after_a_hard_kill_mid_epoch_redoes_the_lost_steps_identically(tmp_path, uninterrupted):
    folder = model_dir(tmp_path)
    run(folder, stop_at_step=6)
    # A SIGKILL leaves no mid-epoch checkpoint: only cp-0000 and log lines for steps 5-6.
    for p in (folder / "model").glob("step-*.cp"):
        p.unlink()
    assert run(folder) == 0
    assert losses(folder) == uninterrupted[0]  # steps 5-6 appear once, recomputed identically


def test_a_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, uninterrupted, capsys):
    folder = model_dir(tmp_path)
    run(folder, stop_at_step=8)
    newest = folder / "model" / "cp-0001.cp"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # torn write
    capsys.readouterr()
    assert run(folder) == 0
    out = capsys.readouterr().out
    assert "warning: skipping" in out and "cp-0001.cp" in out and "resuming from" in out and "cp-0000.cp" in out
    assert losses(folder) == uninterrupted[0]


def test_with_no_readable_checkpoint_the_run_starts_over(tmp_path, data, capsys):
    folder = model_dir(tmp_path, pretraining_setting={"epoch": 2})
    run(folder, stop_at_step=4)
    (folder / "model" / "cp-0000.cp").write_bytes(b"not a checkpoint")
    assert run(folder) == 0
    out = capsys.readouterr().out
    assert "warning: skipping" in out and "cp-0000.cp" in out
    assert [s for s, _ in losses(folder)] == list(range(1, 9))


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_the_rerun_continues(tmp_path, data):
    folder = model_dir(tmp_path, pretraining_setting={"batches_per_epoch": 2000, "epoch": 1})
    log = folder / "model" / "pretrain_output.log"
    cmd = [sys.executable, str(REPO / "code" / "run_pretrain.py"), "--model-dir", str(folder), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and (not log.is_file() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == PREEMPTED_EXIT_CODE, out
    (cp,) = (folder / "model").glob("step-*.cp")
    stopped = checkpoint.load(cp)["step"]
    assert [s for s, _ in losses(folder)] == list(range(1, stopped + 1))
    assert run(folder, stop_at_step=stopped + 2) == PREEMPTED_EXIT_CODE
    assert [s for s, _ in losses(folder)] == list(range(1, stopped + 3))


def test_from_cp_warm_starts_a_longer_model_by_tiling_position_embeddings(tmp_path):
    write_synthetic_data(tmp_path / "data128", seq_len=128, num_train=32, num_dev=8)
    write_synthetic_data(tmp_path / "data512", seq_len=512, num_train=16, num_dev=8)
    short = model_dir(tmp_path, "short", model={"max_seq_len": 128}, data_folder="../data128",
                      pretraining_setting={"epoch": 1, "batches_per_epoch": 2, "validate_batches_per_epoch": 0})
    assert run(short) == 0
    source = short / "model" / "cp-0000.model"
    long = model_dir(tmp_path, "long", model={"max_seq_len": 512}, data_folder="../data512",
                     from_cp="../short/model/cp-0000.model",
                     pretraining_setting={"epoch": 1, "batches_per_epoch": 2, "validate_batches_per_epoch": 0})

    cfg = load_config(long)
    model = NystromformerForMaskedLM(cfg.model)
    missing, unexpected = checkpoint.load_pretrained_weights(model, source, 512)
    assert missing == [] and unexpected == []
    old = checkpoint.load(source)["model_state_dict"][checkpoint.POSITION_KEY]
    new = model.state_dict()[checkpoint.POSITION_KEY]
    assert new.shape == (514, old.shape[1])
    assert torch.equal(new[:2], old[:2])
    for block in range(4):
        assert torch.equal(new[2 + 128 * block: 2 + 128 * (block + 1)], old[2:])

    assert run(long, stop_at_step=1) == PREEMPTED_EXIT_CODE
    warm = read_log(long / "model" / "pretrain_output.log", "warm_start")
    assert len(warm) == 1 and warm[0]["checkpoint"].endswith("cp-0000.model")
    # Once the folder has a checkpoint of its own, from_cp is not applied again: the run resumes.
    assert run(long) == 0
    assert len(read_log(long / "model" / "pretrain_output.log", "resume")) == 1


def test_tiling_needs_a_whole_multiple_of_the_old_length():
    state = {checkpoint.POSITION_KEY: torch.zeros(130, 4)}
    with pytest.raises(checkpoint.CheckpointError, match="multiple of the checkpoint's length 128"):
        checkpoint.extend_position_embeddings(state, 300)


def test_from_cp_reports_missing_and_unexpected_keys(tmp_path):
    cfg = load_config(write_model_dir(tmp_path / "m", tiny_config()))
    model = NystromformerForMaskedLM(cfg.model)
    state = dict(model.state_dict())
    state.pop("mlm_head.bias")
    state["classifier.out_proj.weight"] = torch.zeros(2, 32)
    path = tmp_path / "partial.model"
    torch.save({"model_state_dict": state}, path)
    messages = []
    missing, unexpected = checkpoint.load_pretrained_weights(model, path, 32, log=messages.append)
    assert missing == ["mlm_head.bias"] and unexpected == ["classifier.out_proj.weight"]
    assert any("mlm_head.bias" in m for m in messages) and any("classifier.out_proj.weight" in m for m in messages)


def test_bad_config_stops_the_command_with_the_key_named(tmp_path, data):
    folder = model_dir(tmp_path, model={"num_landmarks": "64"})
    proc = subprocess.run([sys.executable, str(REPO / "code" / "run_pretrain.py"), "--model-dir", str(folder)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "model.num_landmarks: expected an integer" in proc.stderr


def test_data_with_a_larger_vocabulary_than_the_model_is_refused(tmp_path, data):
    folder = model_dir(tmp_path, model={"vocab_size": 32})
    with pytest.raises(Exception, match="model.vocab_size"):
        run(folder)


@pytest.mark.slow
def test_ddp_with_two_cpu_processes_matches_one_process_with_the_same_global_batch(tmp_path, data):
    settings = {"model": {"dropout_prob": 0.0}, "pretraining_setting": {"epoch": 1, "batches_per_epoch": 3}}
    single = model_dir(tmp_path, "single", **settings)
    assert run(single) == 0
    double = model_dir(tmp_path, "ddp", **settings)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--standalone", str(REPO / "code" / "run_pretrain.py"),
                           "--model-dir", str(double), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    one, two = losses(single), losses(double)
    assert [s for s, _ in one] == [s for s, _ in two]
    assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(one, two)), (one, two)
    assert losses(single, "dev")[0][1] == pytest.approx(losses(double, "dev")[0][1], abs=1e-5)


@pytest.mark.parametrize("section,key,value", [("pretraining_setting", "epoch", 4),
                                               ("pretraining_setting", "learning_rate", 1e-3),
                                               ("model", "num_landmarks", 4)])
def test_resuming_under_a_config_that_changes_the_run_is_refused_naming_the_key(tmp_path, data, section, key, value):
    folder = model_dir(tmp_path)
    run(folder, stop_at_step=5)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[section][key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"{section}.{key}: is .* but .*step-00000005.cp was trained with"):
        run(folder)


def test_settings_that_do_not_change_the_run_may_change_on_resume(tmp_path, data):
    # inst_per_gpu only splits the batch differently (with dropout, the masks are drawn differently: off here).
    reference = model_dir(tmp_path, "reference", model={"dropout_prob": 0.0})
    run(reference)
    folder = model_dir(tmp_path, model={"dropout_prob": 0.0})
    run(folder, stop_at_step=6)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["gpu_setting"]["inst_per_gpu"] = 4
    cfg["pretraining_setting"]["batches_per_report"] = 3
    (folder / "config.json").write_text(json.dumps(cfg))
    assert run(folder) == 0
    assert [s for s, _ in losses(folder)] == [s for s, _ in losses(reference)]
    assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(losses(folder), losses(reference)))


def test_a_torn_last_log_line_and_stale_temp_files_do_not_block_resume(tmp_path, uninterrupted):
    folder = model_dir(tmp_path)
    run(folder, stop_at_step=6)
    with open(folder / "model" / "pretrain_output.log", "a") as f:
        f.write('{"type": "train", "ep')  # killed mid-write
    stale = folder / "model" / ".cp-0001.cp.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert run(folder) == 0
    assert losses(folder) == uninterrupted[0]
    assert not stale.exists()


def test_stop_at_step_at_or_past_the_end_finishes_normally(tmp_path, data):
    folder = model_dir(tmp_path, pretraining_setting={"epoch": 1})
    assert run(folder, stop_at_step=4) == 0
    assert run(folder, stop_at_step=4) == 0  # nothing left to do
