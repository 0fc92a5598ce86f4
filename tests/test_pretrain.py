"""Pretraining: learning, exact resume, checkpoint fallback, from_cp warm starts, DDP equivalence."""
import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from nystromformer import checkpoint, plots, shards
from nystromformer.cli import main
from nystromformer.config import ConfigError, config_from_dict, load_config
from nystromformer.mlm import generator, mask_tokens, ordinary_token_ids
from nystromformer.model import IGNORE_INDEX, NystromformerForMaskedLM
from nystromformer.pretrain import (MAX_CONSECUTIVE_SKIPPED_STEPS, PREEMPTED_EXIT_CODE, NonFiniteLosses,
                                    TrainingDiverged, build_scheduler, pretrain)
from nystromformer.resume import check_resumable_data, data_fingerprint
from nystromformer.shards import ShardError, ShardedSequences
from nystromformer.validate import validate

from helpers import (FIRST_WORD, SPECIAL, WeightCasts, read_log, tiny_config, write_model_dir,
                     write_synthetic_data)

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
    ids[:, 30], ids[:, 31] = SPECIAL["unk"], SPECIAL["mask"]  # (the shards never hold these: not targets either)
    inputs, labels = mask_tokens(ids, generator(0, 1, 7), 0.15, SPECIAL, 1000)
    chosen = labels != IGNORE_INDEX
    special = sum(ids == special_id for special_id in SPECIAL.values()).bool()
    assert not (chosen & special).any()
    assert abs(chosen.float().sum() / (~special).sum() - 0.15) < 0.01
    masked = (inputs == SPECIAL["mask"]) & chosen
    kept = (inputs == ids) & chosen
    assert abs(masked.sum() / chosen.sum() - 0.8) < 0.02
    assert abs(kept.sum() / chosen.sum() - 0.1) < 0.02  # ~10% unchanged (+ rare random self-hits)
    assert torch.equal(labels[chosen], ids[chosen])
    again, _ = mask_tokens(ids, generator(0, 1, 7), 0.15, SPECIAL, 1000)
    assert torch.equal(inputs, again)


def test_random_replacements_are_ordinary_tokens_drawn_uniformly_never_special_ones():
    special = {"bos": 0, "pad": 1, "eos": 2, "unk": 3, "mask": 9}  # RoBERTa's 0-3 and a mask id inside the range
    vocab_size = 12
    assert ordinary_token_ids(torch.arange(vocab_size - 5), special).tolist() == [4, 5, 6, 7, 8, 10, 11]
    ids = torch.full((400, 500), 5)
    inputs, labels = mask_tokens(ids, generator(0, 1, 3), 1.0, special, vocab_size)
    swapped = inputs[(inputs != special["mask"]) & (inputs != 5)]
    assert len(swapped) > 10_000 and set(swapped.unique().tolist()) == {4, 6, 7, 8, 10, 11}
    counts = torch.bincount(swapped, minlength=vocab_size)[[4, 6, 7, 8, 10, 11]].double()
    assert (counts / counts.mean() - 1).abs().max() < 0.05  # each of the 7 ordinary ids about 1/7 of the swaps


def test_mlm_loss_falls_on_a_learnable_corpus(tmp_path, data, capsys):
    folder = model_dir(tmp_path, model={"dropout_prob": 0.0},
                       pretraining_setting={"batches_per_epoch": 50, "epoch": 3, "learning_rate": 3e-3})
    assert run(folder) == 0
    dev = read_log(folder / "model" / "pretrain_output.log", "dev")
    assert dev[-1]["loss"] < dev[0]["loss"] - 0.5
    assert dev[-1]["mlm_accu"] > 0.2  # chance is 1/59
    # ... and above the bar of always predicting the commonest masked token, which validation reports beside it
    assert 0 < dev[-1]["commonest_token_accu"] < dev[-1]["mlm_accu"]
    validate(load_config(folder), epochs=[2])
    out = capsys.readouterr().out
    assert f"(commonest token: {dev[-1]['commonest_token_accu']:.4f}), " in out and "no better" not in out
    assert sorted(p.name for p in (folder / "model").glob("cp-*")) == [
        f"cp-{e:04d}.{ext}" for e in range(3) for ext in ("cp", "model")]


@pytest.mark.parametrize("attn_type", ["softmax", "nystrom"])
def test_both_attention_types_pretrain(tmp_path, data, attn_type, capsys):
    folder = model_dir(tmp_path, model={"attn_type": attn_type}, pretraining_setting={"epoch": 1})
    assert run(folder) == 0
    assert len(losses(folder)) == 4
    # the startup line says which Nyström formulation and switches produced the numbers (none for softmax)
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("pretraining "))
    assert start.endswith("; Nyström attention: the reference formulation on cpu") == (attn_type == "nystrom")
    assert "Nyström" not in start or attn_type == "nystrom"


def test_the_startup_line_names_the_fast_paths_switches(monkeypatch, tmp_path):
    from nystromformer.attention.nystrom_fast import describe_switches
    for name, value in (("NYSTROM_IMPL", "fast"), ("NYSTROM_TRITON", "all"), ("NYSTROM_RECOMPUTE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("NYSTROM_OVERLAP", raising=False)
    monkeypatch.delenv("NYSTROM_LAUNCH_SETTINGS", raising=False)
    assert describe_switches(torch.device("cpu")) == ("Nyström attention: fast path, NYSTROM_TRITON=all, "
                                                      "NYSTROM_OVERLAP=0, NYSTROM_RECOMPUTE=1")
    # a launch settings file is named with what it sets, so a log says which launches made its numbers
    (tmp_path / "h100.json").write_text('{"bf16": {"conv_raw": {"rows": 32}}}')
    monkeypatch.setenv("NYSTROM_LAUNCH_SETTINGS", str(tmp_path / "h100.json"))
    assert describe_switches(torch.device("cpu")).endswith(
        f"NYSTROM_RECOMPUTE=1, NYSTROM_LAUNCH_SETTINGS={tmp_path / 'h100.json'} "
        f"({{\"bf16\": {{\"conv_raw\": {{\"rows\": 32}}}}}})")


def test_the_device_runs_one_step_ahead_and_every_loss_is_checked_before_a_checkpoint(tmp_path, data, monkeypatch):
    # Step s + 1 is queued before step s's loss is read back (a read waits for the device), so the host prepares
    # the next batch while the device works; a checkpoint is written only once every queued step's loss is read.
    events = []

    def record(name, original):
        def wrapper(*args, **kwargs):
            events.append(name(*args))
            return original(*args, **kwargs)
        return wrapper
    forward, check = NystromformerForMaskedLM.forward, NonFiniteLosses.check
    monkeypatch.setattr(NystromformerForMaskedLM, "forward", record(lambda *a: "queue", forward))
    monkeypatch.setattr(NonFiniteLosses, "check", record(lambda self, loss, step: f"read {step}", check))
    for save in ("save_epoch", "save_preempted"):
        monkeypatch.setattr(checkpoint, save, record(lambda *a, save=save: save, getattr(checkpoint, save)))
    folder = model_dir(tmp_path, pretraining_setting={"batches_per_epoch": 3, "epoch": 2,
                                                      "validate_batches_per_epoch": 0},
                       gpu_setting={"inst_per_gpu": 16})
    assert run(folder, stop_at_step=5) == PREEMPTED_EXIT_CODE
    assert events == ["queue", "queue", "read 1", "queue", "read 2", "read 3", "save_epoch",
                      "queue", "queue", "read 4", "read 5", "save_preempted"]
    assert [s for s, _ in losses(folder)] == [1, 2, 3, 4, 5]
    # Each step's logged time is a step's duration (to the next step's start, or to its own read for the last one
    # before a checkpoint): none is near zero.
    times = [e["time"] for e in read_log(folder / "model" / "pretrain_output.log")]
    assert min(times) > 0.2 * sorted(times)[len(times) // 2], times


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernels", ["1", "all"])
def test_on_a_gpu_a_training_step_waits_for_the_device_only_to_read_its_loss(tmp_path, data, monkeypatch, kernels):
    # Host-device syncs (copies from pageable memory, boolean indexing, .item()) idle the device while the host
    # prepares and launches; torch's sync debug mode warns at each one. Both kernel sets (NYSTROM_TRITON=all's
    # one-node backward runs an inner autograd graph: a sync there would explain a host-bound step).
    monkeypatch.setenv("NYSTROM_TRITON", kernels)
    at_read = []
    check = NonFiniteLosses.check
    folder = model_dir(tmp_path, model={"attn_type": "nystrom"},
                       pretraining_setting={"batches_per_epoch": 6, "epoch": 1, "validate_batches_per_epoch": 0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def syncs():
            return [str(w.message) for w in caught if "synchronizing CUDA operation" in str(w.message)]
        monkeypatch.setattr(NonFiniteLosses, "check", lambda self, loss, step: (at_read.append(len(syncs())),
                                                                                check(self, loss, step))[1])
        torch.cuda.set_sync_debug_mode("warn")
        try:
            assert pretrain(load_config(folder), device="cuda", show_progress=False) == 0
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert syncs(), "the sync debug mode reported nothing: the count below would prove nothing"
    # Between two reads: one step queued (no sync) and one loss read (one sync).
    assert len(at_read) == 6
    assert [b - a for a, b in zip(at_read[1:], at_read[2:])] == [1] * 4, at_read


def test_compiled_encoder_trains_as_the_eager_one_and_saves_the_same_checkpoint_keys(tmp_path, data, monkeypatch):
    # gpu_setting.compile (CUDA graphs with "reduce-overhead" on a GPU; inductor's CPU code here). One compile
    # thread: no pool of compile workers left running beside the later tests on a 2-core machine.
    import torch._inductor.config
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    from torch._dynamo.utils import counters
    # Dynamo's recompile limit (8) counts every earlier compile of the encoder's forward in this process, whichever
    # model it was (tests/test_model.py compiles several): from a clean cache, the count below is this run's alone
    torch._dynamo.reset()
    runs = {}
    for mode in ("none", "default"):
        folder = model_dir(tmp_path, mode, model={"dropout_prob": 0.0}, pretraining_setting={"epoch": 1},
                           gpu_setting={"inst_per_gpu": 8, "compile": mode})
        counters.clear()
        assert run(folder) == 0
        # Compiled once for training and once for evaluation (no_grad), not again every step: a recompilation
        # per step (a guard on something that changes) would be invisible in the losses and ruin CUDA graphs.
        assert counters["stats"]["unique_graphs"] == (2 if mode != "none" else 0), dict(counters["stats"])
        state = checkpoint.load(folder / "model" / "cp-0000.model")
        runs[mode] = losses(folder), losses(folder, "dev"), sorted(state["model_state_dict"])
    (eager, eager_dev, eager_keys), (compiled, compiled_dev, compiled_keys) = runs["none"], runs["default"]
    assert compiled_keys == eager_keys
    assert [s for s, _ in compiled] == [s for s, _ in eager]
    assert [loss for _, loss in compiled + compiled_dev] == pytest.approx([loss for _, loss in eager + eager_dev],
                                                                        rel=1e-4)


def autocast_on_cpu(monkeypatch, dtype):
    """Pretraining under autocast to ``dtype`` on the CPU (CPU autocast has bf16 and fp16 too), as on a GPU."""
    import nystromformer.pretrain as pretraining
    setup = pretraining.setup_runtime
    monkeypatch.setattr(pretraining, "setup_runtime",
                        lambda mixed_precision, device=None: dataclasses.replace(setup(mixed_precision, device),
                                                                               autocast_dtype=dtype))


@pytest.fixture
def bf16_on_cpu(monkeypatch):
    """Pretraining under bf16 autocast, as on GPUs with bf16."""
    autocast_on_cpu(monkeypatch, torch.bfloat16)


def test_a_mixed_precision_step_casts_each_weight_once_and_runs_its_backward_outside_autocast(tmp_path, data,
                                                                                              bf16_on_cpu,
                                                                                              monkeypatch):
    # One step of 4 micro-batches under bf16 autocast, attention_fp32 on (the default). The weights cannot change
    # within a step, so each is cast once, not once per micro-batch — the joined q, k, v weight of each layer too
    # (model.fixed_weights). And the backward runs outside autocast: under it autocast would cast the fp32
    # attention's backward products to bf16.
    from torch.utils._python_dispatch import TorchDispatchMode
    import nystromformer.pretrain as pretraining
    low_precision_products = []

    class LowPrecisionProducts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.bmm.default and torch.bfloat16 in (args[0].dtype, args[1].dtype):
                low_precision_products.append(func)  # the attention core's products (the projections are mm)
            return func(*args, **(kwargs or {}))
    built = []
    monkeypatch.setattr(pretraining, "NystromformerForMaskedLM",
                        lambda cfg: built.append(NystromformerForMaskedLM(cfg)) or built[-1])
    folder = model_dir(tmp_path, model={"mixed_precision": True, "attn_type": "nystrom"},
                       pretraining_setting={"batch_size": 16, "batches_per_epoch": 1, "epoch": 1,
                                            "validate_batches_per_epoch": 0},
                       gpu_setting={"inst_per_gpu": 4})
    with LowPrecisionProducts(), WeightCasts() as casts:
        assert run(folder) == 0
    assert len(losses(folder)) == 1
    params = casts.of_parameters(built[0])
    assert max(params.values()) == 1, params
    assert [params[f"encoder.layers.{i}.ffn.dense_in.weight"] for i in range(2)] == [1, 1]
    assert casts.of_joined_qkv(built[0]) == built[0].config.num_layers
    assert low_precision_products == []


def test_a_mixed_precision_dev_evaluation_casts_each_weight_once(tmp_path, data):
    from nystromformer.mlm import evaluate
    model = NystromformerForMaskedLM(config_from_dict(tiny_config(mixed_precision=True)).model)
    dev = ShardedSequences(data, "dev")
    with WeightCasts() as casts:  # 16 sequences in micro-batches of 4, in one autocast region
        metrics = evaluate(model, dev, 16, 4, 0, 0.15, torch.device("cpu"), torch.bfloat16)
    assert metrics["num_sequences"] == 16
    params = casts.of_parameters(model)
    assert max(params.values()) == 1 and params["encoder.layers.1.ffn.dense_out.weight"] == 1
    assert casts.of_joined_qkv(model) == model.config.num_layers


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
    console = capsys.readouterr()
    # the warning on stderr (it shows when stdout goes to a file), the progress on stdout
    assert "warning: skipping" in console.err and "cp-0001.cp" in console.err
    assert "warning" not in console.out and "resuming from" in console.out and "cp-0000.cp" in console.out
    assert losses(folder) == uninterrupted[0]


@pytest.mark.parametrize("damage", ["corrupt", "deleted", "weights only"])
def test_a_folder_with_an_earlier_run_but_no_readable_cp_is_refused_and_left_as_it_is(tmp_path, data, damage, capsys):
    folder = model_dir(tmp_path, pretraining_setting={"epoch": 2})
    run(folder, stop_at_step=4)
    cp = folder / "model" / "cp-0000.cp"
    if damage == "corrupt":
        cp.write_bytes(b"not a checkpoint")
    elif damage == "weights only":  # cp-0000.model copied over it: it loads, but holds nothing to resume with
        cp.write_bytes((folder / "model" / "cp-0000.model").read_bytes())
    else:
        cp.unlink()
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in (folder / "model").iterdir()}
    with pytest.raises(checkpoint.CheckpointError, match=r"run/model: holds an earlier run \(.*cp-0000.model.*\) "
                                                         r"but no readable .cp .* Move or delete"):
        run(folder)
    assert {p.name: p.read_bytes() for p in (folder / "model").iterdir()} == before
    says = {"corrupt": "cp-0000.cp: not a checkpoint: not a file torch.save wrote (it begins b'not ')",
            "weights only": "cp-0000.cp: not a resumable checkpoint (no optimizer_state_dict, scheduler_state_dict, "
                            "scaler_state_dict, rng_state): a weights-only .model under a .cp name?",
            "deleted": ""}[damage]
    assert says in capsys.readouterr().err  # a warning: on stderr


@pytest.mark.parametrize("last_logged", [2, 4], ids=["mid-epoch", "killed-writing-the-epoch-checkpoint"])
def test_a_log_of_steps_never_checkpointed_does_not_block_a_fresh_start(tmp_path, data, last_logged):
    folder = model_dir(tmp_path, pretraining_setting={"epoch": 1})
    run(folder, stop_at_step=2)
    # As after a hard kill in the first epoch: logged steps, but nothing saved. The epoch's last step (4) is
    # logged before its checkpoint is written, so a kill during that write leaves it logged and unsaved too.
    (folder / "model" / "step-00000002.cp").unlink()
    log = folder / "model" / "pretrain_output.log"
    lines = [line for line in log.read_text().splitlines() if '"preempted"' not in line]
    last = json.loads(lines[-1])
    lines += [json.dumps(dict(last, step=step)) for step in range(3, last_logged + 1)]
    log.write_text("".join(line + "\n" for line in lines))
    assert run(folder) == 0
    assert [s for s, _ in losses(folder)] == [1, 2, 3, 4]


def start_pretraining(folder):
    """A pretraining subprocess, returned once it has logged a few steps."""
    log = folder / "model" / "pretrain_output.log"
    cmd = [sys.executable, str(REPO / "code" / "run_pretrain.py"), "--model-dir", str(folder), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and (not log.is_file() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize("signum,exit_code", [(signal.SIGTERM, PREEMPTED_EXIT_CODE), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_sigterm_or_ctrl_c_finishes_the_step_writes_a_checkpoint_and_the_rerun_continues(tmp_path, data, signum,
                                                                                          exit_code):
    folder = model_dir(tmp_path, pretraining_setting={"batches_per_epoch": 2000, "epoch": 1})
    proc = start_pretraining(folder)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == exit_code, out
    (cp,) = (folder / "model").glob("step-*.cp")
    stopped = checkpoint.load(cp)["step"]
    assert [s for s, _ in losses(folder)] == list(range(1, stopped + 1))
    assert run(folder, stop_at_step=stopped + 2) == PREEMPTED_EXIT_CODE
    assert [s for s, _ in losses(folder)] == list(range(1, stopped + 3))


def test_a_checkpoint_from_a_node_with_more_gpus_restores_the_rng_of_those_this_node_has(monkeypatch):
    # A run saved on 8 GPUs resumed on 1: each present GPU gets its saved state, the others' are not an error
    # (torch.cuda.set_rng_state_all would index GPUs this node lacks). No GPU here: torch.cuda's calls recorded.
    from nystromformer.resume import rng_state, set_rng_state
    state = {**rng_state(), "cuda": [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]}
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: restored.append((int(s[0]), device)))
    set_rng_state(state)
    assert restored == [(0, 0)]


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
    said = []
    missing, unexpected = checkpoint.load_pretrained_weights(model, source, 512, log=said.append)
    assert missing == [] and unexpected == []
    assert said == ["position embeddings tiled from 128 to 512 positions (4 copies of the checkpoint's)"]
    old = checkpoint.load(source)["model_state_dict"][checkpoint.POSITION_KEY]
    new = model.state_dict()[checkpoint.POSITION_KEY]
    assert new.shape == (514, old.shape[1])
    assert torch.equal(new[:2], old[:2])
    for block in range(4):
        assert torch.equal(new[2 + 128 * block: 2 + 128 * (block + 1)], old[2:])

    # A first attempt killed before any checkpoint logged its warm start (from another from_cp, edited since):
    # the fresh start redoes it, and the log names only the checkpoint used.
    (long / "model").mkdir()
    (long / "model" / "pretrain_output.log").write_text(
        json.dumps({"type": "warm_start", "step": 0, "checkpoint": "an-earlier-from_cp.model"}) + "\n"
        + json.dumps({"type": "train", "step": 1, "loss": 5.0}) + "\n")
    assert run(long, stop_at_step=1) == PREEMPTED_EXIT_CODE
    warm = read_log(long / "model" / "pretrain_output.log", "warm_start")
    assert len(warm) == 1 and warm[0]["checkpoint"].endswith("cp-0000.model")
    # Once the folder has a checkpoint of its own, from_cp is not applied again: the run resumes.
    assert run(long) == 0
    assert len(read_log(long / "model" / "pretrain_output.log", "resume")) == 1

    # Warm-starting from a longer model would need to shorten the position table.
    shorter = model_dir(tmp_path, "shorter", model={"max_seq_len": 128}, data_folder="../data128",
                        from_cp="../long/model/cp-0000.model")
    with pytest.raises(checkpoint.CheckpointError, match=r"shorter/config.json: model.max_seq_len: 128 is shorter "
                                                         r"than the checkpoint's length 512.*from_cp: .*long"):
        run(shorter)


def test_weights_trained_with_another_gelu_are_refused_by_from_cp_and_fine_tuning(tmp_path, data):
    # Checkpoints from before hidden_act existed were trained with the exact GELU; loading them into a model with
    # the new default would silently compute another function.
    source = model_dir(tmp_path, "old", pretraining_setting={"epoch": 1, "validate_batches_per_epoch": 0})
    assert run(source) == 0
    path = source / "model" / "cp-0000.model"
    saved = checkpoint.load(path)
    del saved["config"]["model"]["hidden_act"]  # as written before the key existed
    torch.save(saved, path)
    warm = model_dir(tmp_path, "warm", from_cp="../old/model/cp-0000.model",
                     pretraining_setting={"epoch": 1, "validate_batches_per_epoch": 0})
    with pytest.raises(checkpoint.CheckpointError, match=r"warm/config.json: .*cp-0000.model: was trained with "
                                                         r"model.hidden_act 'gelu', but config.json's model has "
                                                         r"'gelu_tanh'; set \"hidden_act\": \"gelu\""):
        run(warm)
    config = json.loads((warm / "config.json").read_text())
    config["model"]["hidden_act"] = "gelu"
    (warm / "config.json").write_text(json.dumps(config))
    assert run(warm) == 0
    # fine-tuning loads weights the same way
    from nystromformer.model import NystromformerForSequenceClassification
    classifier = NystromformerForSequenceClassification(load_config(source).model, 2)
    with pytest.raises(checkpoint.CheckpointError, match="hidden_act"):
        checkpoint.load_pretrained_weights(classifier, path, 32)


def test_tiling_needs_a_whole_multiple_of_the_old_length():
    state = {checkpoint.POSITION_KEY: torch.zeros(130, 4)}
    with pytest.raises(checkpoint.CheckpointError, match="300 is not a multiple of the checkpoint's length 128"):
        checkpoint.extend_position_embeddings(state, 300)
    with pytest.raises(checkpoint.CheckpointError, match="64 is shorter than the checkpoint's length 128; a warm "
                                                         "start keeps or lengthens"):
        checkpoint.extend_position_embeddings(state, 64)


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


@pytest.mark.parametrize("warmup,epoch,batches_per_epoch", [(0.01, 1, 100), (0.05, 1, 20), (0.5, 1, 2), (0.01, 1, 30),
                                                           (0.4, 1, 2), (0.2, 1, 4)])  # 0.8 of a step
def test_a_warm_up_of_at_most_one_step_starts_at_the_peak_rate_and_decays(warmup, epoch, batches_per_epoch):
    cfg = tiny_config()
    cfg["pretraining_setting"].update(warmup=warmup, epoch=epoch, batches_per_epoch=batches_per_epoch)
    cfg = config_from_dict(cfg)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, cfg)
    rates = []
    for _ in range(epoch * batches_per_epoch):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    peak = cfg.pretraining_setting.learning_rate
    assert rates[0] == pytest.approx(peak, rel=1e-12)
    assert all(a >= b for a, b in zip(rates, rates[1:])) and rates[-1] < peak / 1000


def test_a_one_step_warm_up_pretrains(tmp_path, data):
    folder = model_dir(tmp_path, pretraining_setting={"warmup": 0.5, "epoch": 1, "batches_per_epoch": 2})
    assert run(folder) == 0
    assert [e["lr"] for e in read_log(folder / "model" / "pretrain_output.log")][0] == 2e-3


def test_a_missing_from_cp_is_an_error_naming_the_key_and_the_path(tmp_path, data):
    folder = model_dir(tmp_path, from_cp="../nowhere/cp-0000.model")
    with pytest.raises(ConfigError, match=r"run/config.json: from_cp: .*nowhere/cp-0000.model does not exist"):
        run(folder)


def rewrite_data(tmp_path, **changes):
    for p in (tmp_path / "data").iterdir():
        p.unlink()
    write_synthetic_data(tmp_path / "data", **changes)


@pytest.mark.parametrize("changes,named", [
    ({"seed": 1}, r"training shards listed in .*data/train.json: their first or last rows differ"),
    ({"num_train": 200}, r"data/train.json: the shard list .* 3 shard\(s\) of 256 sequences then, 2 of 200 now"),
    ({"vocab_size": 60}, r"data/meta.json: vocab_size was 64, is 60")])
def test_resuming_on_other_training_data_is_refused_naming_what_changed(tmp_path, data, changes, named):
    folder = model_dir(tmp_path)
    run(folder, stop_at_step=5)
    rewrite_data(tmp_path, **changes)
    with pytest.raises(ConfigError, match=rf"run/config.json: data_folder: .*data is not the data "
                                          rf".*step-00000005.cp was trained on \(.*{named}"):
        run(folder)


def test_the_same_data_rebuilt_with_the_tokenizer_elsewhere_resumes(tmp_path, uninterrupted):
    # meta.json records the tokenizer's absolute path, which differs between clusters and checkouts.
    folder = model_dir(tmp_path)
    run(folder, stop_at_step=5)
    rewrite_data(tmp_path)
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    meta["tokenizer"] = "/elsewhere/checkout/tokenizers/roberta-base"
    (tmp_path / "data" / "meta.json").write_text(json.dumps(meta, indent=4))
    assert run(folder) == 0
    assert losses(folder) == uninterrupted[0]


@pytest.mark.parametrize("section, key, old, new", [("pretraining_setting", "cycle_momentum", False, True),
                                                   ("model", "hidden_act", "gelu", "gelu_tanh")])
def test_a_checkpoint_from_before_a_setting_existed_resumes_only_under_the_value_it_was_trained_with(
        tmp_path, data, section, key, old, new):
    # These keys came with new defaults; older checkpoints were trained with the old behaviour.
    folder = model_dir(tmp_path)
    run(folder, stop_at_step=5)
    cp = folder / "model" / "step-00000005.cp"
    state = checkpoint.load(cp)
    del state["config"][section][key]  # as written before the key existed
    torch.save(state, cp)
    with pytest.raises(ConfigError, match=rf"{section}.{key}: is {json.dumps(new)} but .*step-00000005.cp was "
                                          rf"trained with {json.dumps(old)}"):
        run(folder)
    config = json.loads((folder / "config.json").read_text())
    config[section][key] = old
    (folder / "config.json").write_text(json.dumps(config))
    assert run(folder) == 0


@pytest.mark.parametrize("record", [None, {"meta.json": "0" * 64, "train.json": "0" * 64, "train-*.npy": "0" * 64}],
                         ids=["none", "older format"])
def test_a_checkpoint_without_a_record_of_its_data_in_this_format_still_resumes(tmp_path, data, record, capsys):
    folder = model_dir(tmp_path)
    run(folder, stop_at_step=5)
    cp = folder / "model" / "step-00000005.cp"
    state = checkpoint.load(cp)
    if record is None:
        del state["data"]  # as written before the data were recorded
    else:
        state["data"] = record  # as written when raw file hashes were recorded: nothing to compare
    torch.save(state, cp)
    rewrite_data(tmp_path, seed=1)
    assert run(folder) == 0
    assert "has no record of its training data in this version's format" in capsys.readouterr().err  # said


def test_checkpoints_and_logs_get_the_mode_the_umask_gives_ordinary_files(tmp_path, data):
    folder = model_dir(tmp_path, pretraining_setting={"epoch": 1})
    old = os.umask(0o002)
    try:
        run(folder)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (folder / "model").iterdir()}
    assert modes["cp-0000.cp"] == modes["cp-0000.model"] == modes["pretrain_output.log"] == 0o664, modes


def drop_dev_entries(folder, step):
    log = folder / "model" / "pretrain_output.log"
    lines = [line for line in log.read_text().splitlines()
             if not (json.loads(line)["type"] == "dev" and json.loads(line)["step"] == step)]
    log.write_text("".join(line + "\n" for line in lines))


def test_a_dev_evaluation_lost_after_the_epoch_checkpoint_is_redone_on_resume(tmp_path, uninterrupted):
    folder = model_dir(tmp_path)
    assert run(folder, stop_at_step=4) == PREEMPTED_EXIT_CODE
    drop_dev_entries(folder, 4)  # as if killed between cp-0000.cp and its dev evaluation
    assert run(folder) == 0
    assert losses(folder, "dev") == uninterrupted[1]


def test_rerunning_a_finished_run_says_so_and_leaves_the_log_alone(tmp_path, data, capsys):
    folder = model_dir(tmp_path, pretraining_setting={"epoch": 1})
    assert run(folder) == 0
    log = folder / "model" / "pretrain_output.log"
    before = log.read_text()
    capsys.readouterr()
    assert run(folder) == 0
    assert "already finished" in capsys.readouterr().out
    assert log.read_text() == before
    # Killed before the last dev evaluation: the rerun does only that.
    drop_dev_entries(folder, 4)
    assert run(folder) == 0
    assert log.read_text() == before


def test_pretraining_without_a_dev_split_but_with_dev_batches_is_refused_at_start(tmp_path, data):
    (data / "dev.json").unlink()
    folder = model_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"run/config.json: pretraining_setting.validate_batches_per_epoch: is 2 "
                                          r"but .*data/dev.json does not exist"):
        run(folder)
    assert not (folder / "model" / "pretrain_output.log").exists()


def test_keep_resume_checkpoints_prunes_old_cp_files_but_every_model_file_stays(tmp_path, data):
    # A .cp holds the optimizer state too (~3x the weights): 100 epochs of nystrom-512 would be ~150 GB of them.
    folder = model_dir(tmp_path, pretraining_setting={"keep_resume_checkpoints": 2, "validate_batches_per_epoch": 0})
    assert run(folder, stop_at_step=10) == PREEMPTED_EXIT_CODE
    assert sorted(p.name for p in (folder / "model").glob("*.cp")) == ["cp-0000.cp", "cp-0001.cp", "step-00000010.cp"]
    assert run(folder) == 0  # resumes from the newest, then keeps pruning
    names = sorted(p.name for p in (folder / "model").glob("cp-*"))
    assert names == ["cp-0000.model", "cp-0001.cp", "cp-0001.model", "cp-0002.cp", "cp-0002.model"]


def test_an_empty_dev_split_is_refused_at_start_rather_than_evaluated_as_a_zero_loss(tmp_path):
    # e.g. a small build whose --dev-run sent every run of sequences to train
    write_synthetic_data(tmp_path / "data", num_dev=0)
    folder = model_dir(tmp_path)
    with pytest.raises(ShardError, match=r"data/dev.json: the dev split holds no sequences; or set "
                                         r"pretraining_setting.validate_batches_per_epoch to 0 in .*run/config.json"):
        run(folder)
    with pytest.raises(ShardError, match=r"the dev split holds no sequences$"):  # validate has no such setting
        validate(load_config(folder))


def test_a_diverging_loss_stops_the_run_naming_the_last_good_checkpoint(tmp_path, data):
    folder = model_dir(tmp_path, pretraining_setting={"batches_per_epoch": 1, "epoch": 6})
    assert run(folder, stop_at_step=2) == PREEMPTED_EXIT_CODE
    # Weights that went NaN in step 2: the resumed run's next step (3) has a NaN loss.
    cp = folder / "model" / "cp-0001.cp"
    state = checkpoint.load(cp)
    state["model_state_dict"]["encoder.embeddings.word_embeddings.weight"].fill_(float("nan"))
    torch.save(state, cp)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3.* cp-0000.cp \(step 1\) is the newest "
                                               r"checkpoint from before the divergence; cp-0001.cp already hold"):
        run(folder)
    assert sorted(p.name for p in (folder / "model").glob("*.cp")) == ["cp-0000.cp", "cp-0001.cp"]
    strict = dict(parse_constant=lambda c: pytest.fail(f"{c} in the JSON log"))
    log = (folder / "model" / "pretrain_output.log").read_text().splitlines()
    assert [e["step"] for e in map(lambda line: json.loads(line, **strict), log) if e["type"] == "train"] == [1, 2]


def test_with_loss_scaling_only_a_run_of_non_finite_losses_is_a_divergence(tmp_path):
    # fp16's GradScaler skips a step with a non-finite loss, leaving the weights as they were.
    scaled = NonFiniteLosses(True, tmp_path, 4)
    nan = float("nan")
    assert [scaled.check(loss, step) for step, loss in enumerate([1.0, nan, 1.0, nan], 1)] == [False, True, False, True]
    last = 3 + MAX_CONSECUTIVE_SKIPPED_STEPS  # the run of non-finite losses from step 4 that stops the run
    for step in range(5, last):
        assert scaled.check(float("inf"), step)
    with pytest.raises(TrainingDiverged, match=rf"not finite at {MAX_CONSECUTIVE_SKIPPED_STEPS} steps in a row "
                                               rf"\(4 to {last}"):
        scaled.check(nan, last)
    # Without it (bf16, fp32) the step has already put NaN into the weights: the first one stops the run.
    unscaled = NonFiniteLosses(False, tmp_path, 4)
    assert not unscaled.check(1.0, 1)
    with pytest.raises(TrainingDiverged, match="the training loss is inf at step 2"):
        unscaled.check(float("inf"), 2)


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """Pretraining in fp16 with a GradScaler, as on GPUs without bf16."""
    autocast_on_cpu(monkeypatch, torch.float16)


def test_with_fp16_loss_scaling_an_overflowing_step_is_skipped_logged_and_the_run_goes_on(tmp_path, data,
                                                                                           fp16_on_cpu, monkeypatch):
    calls, forward = [], NystromformerForMaskedLM.forward

    def overflow_in_step_3(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        calls.append(1)
        return dataclasses.replace(out, loss_sum=out.loss_sum * float("inf")) if len(calls) == 3 else out
    monkeypatch.setattr(NystromformerForMaskedLM, "forward", overflow_in_step_3)
    folder = model_dir(tmp_path, pretraining_setting={"batches_per_epoch": 3, "epoch": 2,
                                                      "validate_batches_per_epoch": 0},
                       gpu_setting={"inst_per_gpu": 16})
    assert run(folder) == 0
    strict = dict(parse_constant=lambda c: pytest.fail(f"{c} in the JSON log"))  # jq, JavaScript: no NaN
    entries = [json.loads(line, **strict)
               for line in (folder / "model" / "pretrain_output.log").read_text().splitlines()]
    assert [(e["type"], e["step"]) for e in entries if e["type"] in ("train", "skipped")] == [
        ("train", 1), ("train", 2), ("skipped", 3), ("train", 4), ("train", 5), ("train", 6)]
    state = checkpoint.load(folder / "model" / "cp-0001.cp")
    assert state["scaler_state_dict"]["scale"] < 2.0 ** 16  # halved by the overflow (its default start: 2^16)
    assert all(torch.isfinite(w).all() for w in state["model_state_dict"].values())


def test_with_fp16_a_run_of_skipped_steps_that_spans_a_resume_is_still_a_divergence(tmp_path, data, fp16_on_cpu,
                                                                                       monkeypatch):
    # The count of skipped steps in a row is in the checkpoint: a stop in the middle of the run of them must not
    # reset it (the resumed run would go on past a divergence, and name the wrong first bad step).
    from nystromformer.pretrain import PretrainRun
    queue, forward, current = PretrainRun.queue_step, NystromformerForMaskedLM.forward, {}
    bad = range(3, 3 + MAX_CONSECUTIVE_SKIPPED_STEPS)

    def queue_step(self):
        current["step"] = self.step + 1
        return queue(self)

    def overflow_in_bad_steps(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return dataclasses.replace(out, loss_sum=out.loss_sum * float("inf")) if current["step"] in bad else out
    monkeypatch.setattr(PretrainRun, "queue_step", queue_step)
    monkeypatch.setattr(NystromformerForMaskedLM, "forward", overflow_in_bad_steps)
    folder = model_dir(tmp_path, pretraining_setting={"batches_per_epoch": 4, "epoch": 4,
                                                      "validate_batches_per_epoch": 0},
                       gpu_setting={"inst_per_gpu": 16})
    assert run(folder, stop_at_step=6) == PREEMPTED_EXIT_CODE  # steps 3 to 6 skipped
    assert checkpoint.load(folder / "model" / "step-00000006.cp")["nonfinite_consecutive"] == 4
    with pytest.raises(TrainingDiverged, match=rf"not finite at {MAX_CONSECUTIVE_SKIPPED_STEPS} steps in a row "
                                               rf"\(3 to {bad[-1]};"):
        run(folder)


def test_with_fp16_a_dev_evaluation_that_overflows_is_measured_again_in_fp32(tmp_path, data, fp16_on_cpu,
                                                                             monkeypatch, capsys):
    forward = NystromformerForMaskedLM.forward

    def overflow_in_fp16_evaluation(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if not self.training and torch.is_autocast_enabled("cpu"):
            return dataclasses.replace(out, loss_sum=out.loss_sum * float("inf"))
        return out
    monkeypatch.setattr(NystromformerForMaskedLM, "forward", overflow_in_fp16_evaluation)
    folder = model_dir(tmp_path, pretraining_setting={"epoch": 1})
    assert run(folder) == 0
    dev = read_log(folder / "model" / "pretrain_output.log", "dev")
    assert len(dev) == 1 and dev[0]["loss"] < 10 and dev[0]["precision"] == "fp32 (fp16 overflowed)"
    assert "(in fp32: fp16 overflowed)" in capsys.readouterr().out


def test_with_fp16_a_dev_evaluation_that_does_not_overflow_is_measured_once(tmp_path, data, fp16_on_cpu,
                                                                            monkeypatch, capsys):
    from nystromformer import mlm
    calls, evaluate = [], mlm.evaluate
    monkeypatch.setattr(mlm, "evaluate", lambda *args: (calls.append(args[7]), evaluate(*args))[1])
    assert run(model_dir(tmp_path, pretraining_setting={"epoch": 1})) == 0
    assert calls == [torch.float16] and "in fp32" not in capsys.readouterr().out
    assert "precision" not in read_log(tmp_path / "run" / "model" / "pretrain_output.log", "dev")[0]


def test_the_shuffled_order_is_a_new_permutation_each_pass_and_any_position_can_be_resumed_from():
    from nystromformer.mlm import SampleOrder
    stream = SampleOrder(10, seed=0).indices(0, 30).tolist()
    passes = [stream[i:i + 10] for i in (0, 10, 20)]
    assert all(sorted(p) == list(range(10)) for p in passes) and len({tuple(p) for p in passes}) == 3
    assert SampleOrder(10, seed=0).indices(15, 10).tolist() == stream[15:25]
    assert SampleOrder(10, seed=1).indices(0, 10).tolist() != passes[0]


def test_a_dev_split_smaller_than_the_dev_batches_asked_for_is_evaluated_whole(tmp_path, data):
    from nystromformer.mlm import evaluate
    from nystromformer.shards import ShardedSequences
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(config_from_dict(tiny_config()).model)
    dev = ShardedSequences(data, "dev")
    whole = evaluate(model, dev, len(dev), 8, 0, 0.15, torch.device("cpu"))
    assert evaluate(model, dev, 100 * len(dev), 8, 0, 0.15, torch.device("cpu")) == whole


def test_dev_evaluation_of_part_of_the_split_takes_seeded_rows_from_all_of_it_not_its_first_rows():
    # The dev split holds its datasets one after another (wiki first): a prefix would measure one corpus only.
    from nystromformer.mlm import dev_sample
    rows = dev_sample(10_000, 2_000, seed=0)
    assert len(set(rows.tolist())) == 2_000 and (np.diff(rows) > 0).all()  # distinct, in row order
    quarters = np.bincount(rows // 2_500, minlength=4)
    assert (abs(quarters - 500) < 75).all(), quarters  # ~a quarter from each quarter of the split
    assert np.array_equal(rows, dev_sample(10_000, 2_000, seed=0))  # the same rows for every checkpoint
    assert not np.array_equal(rows, dev_sample(10_000, 2_000, seed=1))
    assert np.array_equal(dev_sample(300, 2_000, seed=0), np.arange(300))  # all of a smaller split


def test_a_second_run_on_a_busy_model_folder_is_refused_and_leaves_the_log_alone(tmp_path, data):
    folder = model_dir(tmp_path, pretraining_setting={"batches_per_epoch": 2000, "epoch": 1})
    proc = start_pretraining(folder)
    try:
        with pytest.raises(checkpoint.CheckpointError, match=r"another pretraining run is using this model folder "
                                                             r"\(.* pid \d+ holds .*pretrain.lock\)"):
            run(folder)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == PREEMPTED_EXIT_CODE, out
    steps = [s for s, _ in losses(folder)]
    assert steps == list(range(1, len(steps) + 1))  # one run's lines, in order
    assert (folder / "model" / "pretrain.lock").exists() and run(folder, stop_at_step=steps[-1] + 1) == 143


@pytest.mark.parametrize("broken", ["model folder is a file", "lock is a folder"])
def test_a_model_folder_that_cannot_be_locked_is_an_error_naming_the_key(tmp_path, data, broken):
    folder = model_dir(tmp_path)
    if broken == "model folder is a file":
        (folder / "model").write_text("")
    else:
        (folder / "model" / "pretrain.lock").mkdir(parents=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"run/config.json: model_checkpoints: cannot create "
                                                         r".*run/model or take its lock .*Error"):
        run(folder)


def test_on_a_file_system_without_locks_the_run_warns_and_goes_on(tmp_path, data, monkeypatch, capsys):
    import errno
    import fcntl

    def no_flock(fd, operation):  # as Lustre mounted without -o flock answers
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    folder = model_dir(tmp_path, pretraining_setting={"epoch": 1})
    assert run(folder) == 0
    assert "does not support locks" in capsys.readouterr().err
    assert [s for s, _ in losses(folder)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_under_ddp_a_lock_failure_on_rank_0_stops_every_rank_at_once(tmp_path, data):
    folder = model_dir(tmp_path)
    (folder / "model" / "pretrain.lock").mkdir(parents=True)  # os.open fails on rank 0 only
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           str(REPO / "code" / "run_pretrain.py"), "--model-dir", str(folder), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=120)  # not the 30-minute gloo timeout
    assert proc.returncode != 0
    assert "model_checkpoints: cannot create" in proc.stderr and "see rank 0's error" in proc.stderr, proc.stderr


def test_from_cp_in_the_run_s_own_checkpoint_folder_is_no_earlier_run(tmp_path, data):
    source = model_dir(tmp_path, "source", pretraining_setting={"epoch": 1, "validate_batches_per_epoch": 0})
    assert run(source) == 0
    # A .model copied into the new folder under a name the new run (3 epochs) does not write.
    folder = model_dir(tmp_path, from_cp="model/cp-0007.model")
    (folder / "model").mkdir()
    (folder / "model" / "cp-0007.model").write_bytes((source / "model" / "cp-0000.model").read_bytes())
    assert run(folder, stop_at_step=1) == PREEMPTED_EXIT_CODE
    assert read_log(folder / "model" / "pretrain_output.log", "warm_start")[0]["checkpoint"].endswith("cp-0007.model")


@pytest.mark.parametrize("name, why", [
    ("cp-0001.model", "the run writes its own checkpoints there and would overwrite it"),
    ("cp-0002.model", "the run writes its own checkpoints there and would overwrite it"),  # the last epoch's
    ("cp-0007.cp", "a .cp there is taken for this run's own checkpoint and resumed from, not warm-started from"),
    ("step-00000001.cp", "a .cp there is taken for this run's own checkpoint"),
])
def test_from_cp_that_the_run_would_overwrite_or_resume_from_is_refused_naming_the_key(tmp_path, data, name, why):
    source = model_dir(tmp_path, "source", pretraining_setting={"epoch": 1, "validate_batches_per_epoch": 0})
    assert run(source) == 0
    folder = model_dir(tmp_path, from_cp=f"model/{name}")  # a 3-epoch run: it writes cp-0000 to cp-0002
    assert load_config(folder).pretraining_setting.epoch == 3
    (folder / "model").mkdir()
    weights = (source / "model" / ("cp-0000.cp" if name.endswith(".cp") else "cp-0000.model")).read_bytes()
    (folder / "model" / name).write_bytes(weights)
    with pytest.raises(ConfigError, match=rf"run/config.json: from_cp: .*{re.escape(name)} lies in this run's "
                                          rf"checkpoint folder \({re.escape(why)}"):
        run(folder)
    assert sorted(p.name for p in (folder / "model").iterdir()) == sorted([name, "pretrain.lock"])
    assert (folder / "model" / name).read_bytes() == weights


def write_log(folder):
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "pretrain_output.log").write_text(
        "".join(json.dumps({"type": kind, "epoch": 0, "step": s, "loss": 4.0 / s, "mlm_accu": 0.1 * s}) + "\n"
                for s, kind in ((1, "train"), (2, "train"), (2, "dev"))))
    return folder


def test_plot_labels_runs_whose_folders_share_a_name_by_the_shortest_distinguishing_path(tmp_path):
    runs = [write_log(model_dir(tmp_path / parent, "run")) for parent in ("a", "b")]
    runs.append(write_log(model_dir(tmp_path, "other")))
    assert list(plots.run_labels([str(r) for r in runs])) == ["a/run", "b/run", "other"]
    args = argparse.Namespace(model_dir=[str(r) for r in runs], output=tmp_path / "curves.png")
    assert plots.run(args) == 0
    assert args.output.read_bytes()[:4] == b"\x89PNG"


def test_plot_reports_a_missing_log_on_stderr(tmp_path, capsys):
    folder = model_dir(tmp_path)
    assert main(["plot", "--model-dir", str(folder), "--model-dir", str(folder), "--output",
                 str(tmp_path / "curves.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model-dir") and "is given more than once" in err
    assert main(["plot", "--model-dir", str(folder), "--output", str(tmp_path / "curves.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "error:" in err and "pretrain_output.log does not exist" in err


@pytest.mark.parametrize("output", ["curves", "curves.xyz", ".", "config.json/curves.png", "a-folder.png"])
def test_plot_refuses_an_output_that_is_not_an_image_file_it_can_write(tmp_path, capsys, output):
    folder = write_log(model_dir(tmp_path))  # (.pdf, .svg and the other formats matplotlib writes work)
    if output == "a-folder.png":
        (folder / output).mkdir()
    assert main(["plot", "--model-dir", str(folder), "--output", str(folder / output)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --output {folder / output}") and len(err.splitlines()) == 1, err


def test_plot_leaves_out_entries_it_cannot_plot_and_says_so(tmp_path, capsys):
    folder = write_log(model_dir(tmp_path))
    with open(folder / "model" / "pretrain_output.log", "a") as log:
        log.write('[1, 2]\n{}\n{"type": "train", "step": 3}\n')
    assert main(["plot", "--model-dir", str(folder), "--output", str(tmp_path / "c.png")]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 unreadable line(s) (line 4: a torn write?)" in err
    assert "1 train/dev entry without step, loss, mlm_accu left out" in err
    assert any(line.startswith("warning: ") and "1 train/dev entry without" in line for line in err.splitlines()), err
    (folder / "model" / "pretrain_output.log").write_text('{"type": "config"}\n')
    assert main(["plot", "--model-dir", str(folder), "--output", str(tmp_path / "c.png")]) == 2
    assert "pretrain_output.log: no train or dev entry to plot" in capsys.readouterr().err


def test_every_setting_that_shapes_the_run_is_refused_on_resume_and_only_those_listed_may_change(tmp_path):
    from nystromformer.resume import RESUME_MAY_CHANGE, check_resumable_config
    cfg = config_from_dict(tiny_config())
    current = cfg.to_dict()
    for section in ("model", "pretraining_setting", "gpu_setting"):
        for key, value in current[section].items():
            other = (not value if isinstance(value, bool) else value + 1 if isinstance(value, (int, float))
                     else 7 if value is None else f"other-{value}")
            saved = json.loads(json.dumps(current))
            saved[section][key] = other
            if key in RESUME_MAY_CHANGE[section]:
                check_resumable_config(saved, cfg, "cp-0000.cp")
            else:
                with pytest.raises(ConfigError, match=rf"{section}.{key}: is .* but cp-0000.cp was trained with"):
                    check_resumable_config(saved, cfg, "cp-0000.cp")
    # how the work is split and reported, never what is computed (weight_init: only step 0, which a resume loads)
    assert RESUME_MAY_CHANGE == {
        "model": {"attention_grad_checkpointing", "gelu_grad_checkpointing", "mixed_precision", "weight_init"},
        "pretraining_setting": {"batches_per_report", "validate_batches_per_epoch", "keep_resume_checkpoints"},
        "gpu_setting": {"inst_per_gpu", "rows_per_pass", "compile"}}


def test_each_epoch_reads_the_next_sequences_of_one_seeded_shuffled_order(tmp_path, data, monkeypatch):
    from nystromformer.mlm import SampleOrder
    from nystromformer.shards import ShardedSequences
    read, rows = [], ShardedSequences.rows

    def record(self, indices):
        if self.split == "train":
            read.extend(int(i) for i in indices)
        return rows(self, indices)

    monkeypatch.setattr(ShardedSequences, "rows", record)
    folder = model_dir(tmp_path, pretraining_setting={"seed": 3})  # 3 epochs x 4 batches x 16 of 256 sequences
    assert run(folder) == 0
    assert read == SampleOrder(256, 3).indices(0, 192).tolist() and len(set(read)) == 192  # no epoch rereads


def test_the_training_log_and_checkpoints_name_the_epoch_each_step_belongs_to(tmp_path, data):
    folder = model_dir(tmp_path, pretraining_setting={"validate_batches_per_epoch": 0})
    assert run(folder, stop_at_step=6) == PREEMPTED_EXIT_CODE
    assert run(folder) == 0
    train = read_log(folder / "model" / "pretrain_output.log")
    assert [(e["step"], e["epoch"]) for e in train] == [(s, (s - 1) // 4) for s in range(1, 13)]
    for epoch in range(3):
        weights = checkpoint.load(folder / "model" / f"cp-{epoch:04d}.model")
        resume = checkpoint.load(folder / "model" / f"cp-{epoch:04d}.cp")
        assert (weights["epoch"], resume["epoch"], weights["step"], resume["step"]) == (epoch, epoch, 4 * (epoch + 1),
                                                                                        4 * (epoch + 1))


def test_a_dev_evaluation_lost_after_a_later_epoch_is_redone_on_resume(tmp_path, uninterrupted):
    folder = model_dir(tmp_path)
    assert run(folder, stop_at_step=8) == PREEMPTED_EXIT_CODE
    drop_dev_entries(folder, 8)  # killed between cp-0001.cp and its dev evaluation; step 4's is there
    assert run(folder) == 0
    assert losses(folder, "dev") == uninterrupted[1]


def test_a_log_past_the_first_epoch_without_any_checkpoint_is_an_earlier_run_not_overwritten(tmp_path, data):
    folder = model_dir(tmp_path)
    (folder / "model").mkdir()
    log = folder / "model" / "pretrain_output.log"
    log.write_text("".join(json.dumps({"type": "train", "epoch": (s - 1) // 4, "step": s, "loss": 4.0}) + "\n"
                           for s in range(1, 7)))  # 6 steps at 4 a batch: epoch 0's checkpoint was written once
    before = log.read_text()
    with pytest.raises(checkpoint.CheckpointError, match=r"holds an earlier run \(pretrain_output.log\)"):
        run(folder)
    assert log.read_text() == before


@pytest.mark.parametrize("model, named", [
    ({"vocab_size": 32}, r"model.vocab_size: 32 is smaller than the data's vocabulary \(64 in .*data/meta.json\)"),
    ({"max_seq_len": 16}, r"model.max_seq_len: 16 is shorter than the data's sequences \(32 in .*data/meta.json\)"),
    # a longer model would train at the data's length, its later positions never (nystrom-4096 on 512 shards)
    ({"max_seq_len": 64}, r"model.max_seq_len: 64 is longer than the data's sequences \(32 in .*data/meta.json\): "
                          r"the positions past 32 would never be trained; point data_folder at shards built at 64 "
                          r"tokens \(build-shards --seq-len 64\), or set max_seq_len to 32"),
    ({"pad_token_id": 0}, r"model.pad_token_id: 0 differs from the data's pad id 1 \(.*data/meta.json\)"),
])
def test_data_that_does_not_fit_the_model_is_refused_naming_the_key(tmp_path, data, model, named):
    folder = model_dir(tmp_path, model=model)
    with pytest.raises(ConfigError, match=rf"run/config.json: {named}"):
        run(folder)
    assert not (folder / "model").exists()   # refused before the run's folder (and its lock) is made


def test_resuming_on_data_with_other_special_tokens_is_refused(tmp_path, data):
    folder = model_dir(tmp_path)
    run(folder, stop_at_step=5)
    meta = json.loads((data / "meta.json").read_text())
    meta["special_tokens"]["mask"] = 5  # same rows, another mask id: the model would learn another token
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"data/meta.json: special_tokens was .*\"mask\": 4.*, is .*\"mask\": 5"):
        run(folder)


def test_the_optimizer_is_adamw_with_the_configs_rate_decay_and_epsilon():
    from nystromformer.pretrain import build_optimizer
    cfg = tiny_config()
    cfg["pretraining_setting"].update(learning_rate=3e-4, weight_decay=0.05, adam_eps=1e-8)
    optimizer = build_optimizer(torch.nn.Linear(2, 2), config_from_dict(cfg), torch.device("cpu"))
    [group] = optimizer.param_groups
    assert isinstance(optimizer, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.9, 0.999), 1e-8, 0.05)


def test_the_rate_rises_linearly_over_the_warm_up_then_falls_linearly(tmp_path):
    from nystromformer.pretrain import build_scheduler
    cfg = tiny_config()
    cfg["pretraining_setting"].update(learning_rate=1.0, warmup=0.2, epoch=1, batches_per_epoch=10)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, config_from_dict(cfg))
    rates = []
    for _ in range(10):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    # OneCycle: from peak/25 to the peak at step 1 (20% of 10 steps, counted from 0), then a straight line down.
    assert rates[0] == pytest.approx(1 / 25) and rates[1] == pytest.approx(1.0)
    falls = [a - b for a, b in zip(rates[1:], rates[2:])]
    assert falls == pytest.approx([falls[0]] * len(falls)) and falls[0] > 0


@pytest.mark.parametrize("warmup", [0.2, 0.1])  # the peak at step 2, or at step 1 (a one-step warm-up)
def test_adams_beta1_cycles_against_the_rate_as_the_papers_schedule_or_stays_at_point_nine(warmup):
    # The authors' OneCycleLR kept torch's default momentum cycling: beta1 0.95 -> 0.85 at the peak -> 0.95.
    from nystromformer.pretrain import build_optimizer, build_scheduler
    for cycle in (True, False):
        cfg = tiny_config()
        cfg["pretraining_setting"].update(learning_rate=1.0, warmup=warmup, epoch=1, batches_per_epoch=10,
                                          cycle_momentum=cycle)
        cfg = config_from_dict(cfg)
        optimizer = build_optimizer(torch.nn.Linear(1, 1), cfg, torch.device("cpu"))
        scheduler = build_scheduler(optimizer, cfg)
        rates, beta1 = [], []
        for _ in range(10):
            rates.append(scheduler.get_last_lr()[0])
            beta1.append(optimizer.param_groups[0]["betas"][0])
            optimizer.step()
            scheduler.step()
        peak = rates.index(max(rates))
        assert peak == round(warmup * 10) - 1 if warmup > 0.1 else peak == 0
        if cycle:
            assert beta1[peak] == pytest.approx(0.85) and beta1[-1] > beta1[peak] and beta1[0] >= beta1[peak]
            # beta1 moves against the rate: up where it falls, in straight lines
            assert all((b2 - b1) * (r2 - r1) <= 0 for b1, b2, r1, r2 in zip(beta1, beta1[1:], rates, rates[1:]))
        else:
            assert beta1 == [0.9] * 10


def test_max_grad_norm_clips_every_step(tmp_path, data, monkeypatch):
    clipped, clip = [], torch.nn.utils.clip_grad_norm_

    def recorded(params, max_norm, *args, **kwargs):
        clipped.append(max_norm)
        return clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recorded)
    folder = model_dir(tmp_path, pretraining_setting={"max_grad_norm": 0.5, "epoch": 1,
                                                      "validate_batches_per_epoch": 0})
    assert run(folder) == 0
    assert clipped == [0.5] * 4
    clipped.clear()
    assert run(model_dir(tmp_path, "unclipped", pretraining_setting={"epoch": 1})) == 0
    assert clipped == []


def test_a_dev_loss_that_is_not_finite_stops_the_run_as_a_divergence(tmp_path, data, monkeypatch):
    forward = NystromformerForMaskedLM.forward

    def nan_in_evaluation(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return out if self.training else dataclasses.replace(out, loss_sum=out.loss_sum * float("nan"))

    monkeypatch.setattr(NystromformerForMaskedLM, "forward", nan_in_evaluation)
    folder = model_dir(tmp_path)
    with pytest.raises(TrainingDiverged, match=r"the dev loss is nan after step 4"):
        run(folder)
    strict = dict(parse_constant=lambda c: pytest.fail(f"{c} in the JSON log"))
    log = (folder / "model" / "pretrain_output.log").read_text().splitlines()
    assert not [e for e in (json.loads(line, **strict) for line in log) if e["type"] == "dev"]


def test_a_from_cp_whose_weights_have_other_shapes_is_an_error_naming_the_weight_and_both_shapes(tmp_path, data):
    source = model_dir(tmp_path, "source", model={"transformer_hidden_dim": 48},
                       pretraining_setting={"epoch": 1, "validate_batches_per_epoch": 0})
    assert run(source) == 0
    folder = model_dir(tmp_path, from_cp="../source/model/cp-0000.model")
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"run/config.json: .*cp-0000.model: encoder.layers.0.ffn.*has shape \(48, 32\), the "
                             r"model expects \(64, 32\).*\(from_cp: "):
        run(folder)


def test_a_micro_batch_that_does_not_divide_the_batch_trains_every_sequence(tmp_path, data):
    # ("exact" init: the "original" one scales by a maximum over each micro-batch, which other sizes move slightly)
    settings = dict(model={"dropout_prob": 0.0, "inv_coeff_init_option": "exact"},
                    pretraining_setting={"epoch": 1, "validate_batches_per_epoch": 0})
    divides, leaves_a_remainder = model_dir(tmp_path, "by-8", **settings), model_dir(tmp_path, "by-5", **settings,
                                                                                     gpu_setting={"inst_per_gpu": 5})
    assert run(divides) == 0 and run(leaves_a_remainder) == 0  # 16 = 5 + 5 + 5 + 1
    assert [loss for _, loss in losses(leaves_a_remainder)] == pytest.approx([loss for _, loss in losses(divides)],
                                                                             abs=1e-5)


def test_passes_of_several_micro_batches_train_as_a_pass_per_micro_batch(tmp_path, data, capsys):
    # rows_per_pass runs the recipe's micro-batches (inst_per_gpu) several to a pass; Nyström's "original" init still
    # takes its max over each micro-batch, so the weights are those of a pass per micro-batch to rounding — and not
    # those of micro-batches of rows_per_pass, which the recipe would change.
    settings = dict(model={"dropout_prob": 0.0}, pretraining_setting={"epoch": 1, "validate_batches_per_epoch": 1})
    runs = {name: model_dir(tmp_path, name, **settings, gpu_setting=gpu) for name, gpu in (
        ("per-micro-batch", {"inst_per_gpu": 2}), ("grouped", {"inst_per_gpu": 2, "rows_per_pass": 8}),
        ("micro-batch-8", {"inst_per_gpu": 8}))}
    weights = {}
    for name, folder in runs.items():
        capsys.readouterr()
        assert run(folder) == 0
        weights[name] = torch.load(folder / "model" / "cp-0000.model", weights_only=True)["model_state_dict"]
        if name == "grouped":
            assert "passes of 8 rows (micro-batches of 2 each) x 2 a step" in capsys.readouterr().out

    def distance(a, b):
        return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)
    assert distance(weights["grouped"], weights["per-micro-batch"]) < 1e-5
    assert distance(weights["micro-batch-8"], weights["per-micro-batch"]) > 1e-4
    dev = {name: losses(folder, "dev")[0][1] for name, folder in runs.items()}
    assert dev["grouped"] == pytest.approx(dev["per-micro-batch"], rel=1e-6)
    # validate measures a checkpoint with the same passes and groups: pretraining's figure (without the groups,
    # 5e-7 off here)
    validate(load_config(runs["grouped"]), epochs=[0])
    log = (runs["grouped"] / "model" / "validation_output.log").read_text().splitlines()
    assert json.loads(log[-1])["loss"] == pytest.approx(dev["grouped"], rel=1e-8)


def test_a_first_ctrl_c_asks_to_stop_a_second_stops_at_once_and_the_handlers_are_restored_after():
    from nystromformer.pretrain import PreemptionFlag
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with PreemptionFlag() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_repeating_a_stop_at_step_trains_and_logs_nothing_more(tmp_path, data):
    folder = model_dir(tmp_path)
    assert run(folder, stop_at_step=5) == PREEMPTED_EXIT_CODE
    log = (folder / "model" / "pretrain_output.log").read_text()
    assert json.loads(log.splitlines()[-1]) == {"type": "preempted", "step": 5,
                                               "checkpoint": str(folder / "model" / "step-00000005.cp")}
    assert run(folder, stop_at_step=5) == PREEMPTED_EXIT_CODE
    assert (folder / "model" / "pretrain_output.log").read_text() == log


def test_the_log_counts_sequences_seen_and_dates_dev_points_by_epoch_and_step(tmp_path, data):
    folder = model_dir(tmp_path)
    assert run(folder) == 0
    log = folder / "model" / "pretrain_output.log"
    assert [e["inst_pass"] for e in read_log(log)] == [16 * s for s in range(1, 13)]
    assert [(e["epoch"], e["step"]) for e in read_log(log, "dev")] == [(0, 4), (1, 8), (2, 12)]


def test_a_divergence_is_one_error_line_naming_the_newest_checkpoint_from_before_it(tmp_path, data, capsys):
    folder = model_dir(tmp_path, pretraining_setting={"batches_per_epoch": 1, "epoch": 6})
    assert run(folder, stop_at_step=3) == PREEMPTED_EXIT_CODE
    cp = folder / "model" / "cp-0002.cp"  # weights gone NaN in step 3: steps 1 and 2 are good
    state = checkpoint.load(cp)
    state["model_state_dict"]["encoder.embeddings.word_embeddings.weight"].fill_(float("nan"))
    torch.save(state, cp)
    capsys.readouterr()
    assert main(["pretrain", "--model-dir", str(folder), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: training diverged") and len(err.splitlines()) == 1, err
    assert "cp-0001.cp (step 2) is the newest checkpoint from before the divergence" in err


def test_a_signal_during_the_last_step_exits_as_preempted_and_the_rerun_does_the_last_dev_pass(tmp_path, data,
                                                                                                monkeypatch):
    check = NonFiniteLosses.check

    def signal_in_the_last_step(self, loss, step):
        if step == 12:
            os.kill(os.getpid(), signal.SIGTERM)
        return check(self, loss, step)

    monkeypatch.setattr(NonFiniteLosses, "check", signal_in_the_last_step)
    folder = model_dir(tmp_path)
    assert run(folder) == PREEMPTED_EXIT_CODE  # a restart policy reruns it: the last dev pass is not done
    log = folder / "model" / "pretrain_output.log"
    assert [e["step"] for e in read_log(log, "dev")] == [4, 8]
    monkeypatch.setattr(NonFiniteLosses, "check", check)
    assert run(folder) == 0
    assert [e["step"] for e in read_log(log, "dev")] == [4, 8, 12]


def test_plot_draws_the_loss_and_the_accuracy_of_each_log_in_their_panels(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes
    drawn, plot = [], Axes.plot

    def record(self, x, y, *args, **kwargs):
        drawn.append((self, list(y)))
        return plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", record)
    log = tmp_path / "log"
    log.write_text("".join(json.dumps(e) + "\n" for e in [
        {"type": "train", "step": 1, "loss": 4.0, "mlm_accu": 0.1}, {"type": "dev", "step": 1, "loss": 3.0,
                                                                      "mlm_accu": 0.2}]))
    plots.plot_pretraining({"r": log}, tmp_path / "c.png")
    panels = {}
    for axes, y in drawn:
        panels.setdefault(axes.get_ylabel(), []).append(y)
    assert panels == {"MLM loss": [[4.0], [3.0]], "MLM accuracy": [[0.1], [0.2]]}  # train, then dev


def test_plot_smooths_the_train_loss_by_a_trailing_mean_that_starts_and_ends_on_the_raw_level(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes
    drawn, plot = [], Axes.plot

    def record(self, x, y, *args, **kwargs):
        drawn.append((kwargs.get("label"), list(y)))
        return plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", record)
    log = tmp_path / "log"
    log.write_text("".join(json.dumps({"type": "train", "step": s, "loss": 4.0 if s <= 100 else 2.0, "mlm_accu": 0.1})
                           + "\n" for s in range(1, 201)))
    plots.plot_pretraining({"r": log}, tmp_path / "c.png")
    (smooth,) = [y for label, y in drawn if label == "r train"]
    # A mean over the points there are (not a full window from the first step): a flat start stays flat.
    assert smooth[:100] == [4.0] * 100 and smooth[-1] == 2.0
    assert all(a >= b for a, b in zip(smooth, smooth[1:]))


def test_plot_draws_every_run_in_its_own_colour_beyond_the_default_ten(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes
    drawn, plot = [], Axes.plot

    def record(self, x, y, *args, **kwargs):
        drawn.append((kwargs["label"].split()[0] if "label" in kwargs else None, str(kwargs["color"])))
        return plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", record)
    logs = {}
    for run_number in range(12):
        logs[f"run{run_number}"] = tmp_path / f"{run_number}.log"
        logs[f"run{run_number}"].write_text(json.dumps({"type": "train", "step": 1, "loss": 4.0, "mlm_accu": 0.1}))
    plots.plot_pretraining(logs, tmp_path / "c.png")
    labelled = {label: colour for label, colour in drawn if label}
    assert sorted(labelled) == sorted(logs) and len(set(labelled.values())) == 12


def test_a_change_to_the_first_or_last_row_of_any_training_shard_refuses_the_resume(tmp_path, data):
    # Only the first and last rows of each shard are read (resume.py): a change there, in any shard (the last one
    # included), is other data.
    cfg = load_config(model_dir(tmp_path))

    def fingerprint():
        return data_fingerprint(cfg.data_dir, ShardedSequences(cfg.data_dir, "train"))
    saved = fingerprint()
    meta = json.loads((data / "meta.json").read_text())
    names = [entry["file"] for entry in json.loads((data / "train.json").read_text())["shards"]]
    assert len(names) == 3  # of 100, 100 and 56 rows
    for name in names:
        original = np.load(data / name)
        for row in (0, len(original) - 1):
            changed = original.copy()
            changed[row, 1:-1] = FIRST_WORD + (changed[row, 1:-1] - FIRST_WORD + 1) % (64 - FIRST_WORD)
            shards.write_shard(data / name, changed, meta)  # same shape and shard list: only that row differs
            with pytest.raises(ConfigError, match=r"data_folder: .*data is not the data cp-0000.cp was trained "
                                                  r"on \(the training shards listed in .*data/train.json: their "
                                                  r"first or last rows differ\)"):
                check_resumable_data(saved, cfg, fingerprint(), "cp-0000.cp")
        shards.write_shard(data / name, original, meta)
    check_resumable_data(saved, cfg, fingerprint(), "cp-0000.cp")  # restored: the same data again



@pytest.mark.parametrize("key, value", [("datasets", ["wiki", "books"]), ("dev_fraction", 0.01), ("dev_run", 512),
                                        ("seed", 7), ("shard_size", 50)])
def test_a_change_to_a_meta_json_build_setting_refuses_the_resume_naming_it(tmp_path, data, key, value):
    # build-shards records how the token stream was made (shards.py: "a resumed pretraining run checks them");
    # the rows and shard list stay the same here: only the recorded setting tells the data apart. The tokenizer's
    # path, which differs between checkouts, is not compared.
    cfg = load_config(model_dir(tmp_path))
    saved = data_fingerprint(cfg.data_dir, ShardedSequences(cfg.data_dir, "train"))
    meta = json.loads((data / "meta.json").read_text())
    shards.write_meta(data, {**meta, key: value, "tokenizer": "/elsewhere/tokenizers/roberta-base"})
    with pytest.raises(ConfigError, match=rf"data/meta.json: {key} was null, is {re.escape(json.dumps(value))}\)"):
        check_resumable_data(saved, cfg, data_fingerprint(cfg.data_dir, ShardedSequences(cfg.data_dir, "train")),
                             "cp-0000.cp")


def test_a_checkpoint_the_machine_cannot_read_is_not_called_damaged(tmp_path, monkeypatch):
    import torch

    from nystromformer import checkpoint
    path = tmp_path / "cp-0001.model"
    path.write_bytes(b"PK\x03\x04")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(torch, "load", refused)
    with pytest.raises(PermissionError):  # cli.run_command reports it as "permission denied", naming the file
        checkpoint.load(path)


def test_the_progress_bar_shows_each_reported_loss_beside_the_count_that_includes_its_step(tmp_path, data, capsys):
    # "3/6 … loss=X" must mean X is step 3's loss (as the log has it), not the step after the one counted.
    import re
    folder = model_dir(tmp_path, pretraining_setting={"batches_per_epoch": 6, "epoch": 1, "batches_per_report": 1,
                                                      "validate_batches_per_epoch": 0})
    assert pretrain(load_config(folder), show_progress=True) == 0
    shown = [(int(n), float(x)) for n, x in re.findall(r"(\d+)/6 [^\r\n]*?loss=([\d.]+)", capsys.readouterr().err)]
    logged = {step: round(loss, 4) for step, loss in losses(folder)}
    assert shown and shown[-1][0] == 6, shown
    assert all(logged[n] == x for n, x in shown), (shown, logged)
