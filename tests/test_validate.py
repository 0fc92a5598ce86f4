"""Validation of pretraining checkpoints on the dev split."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nystromformer.checkpoint import CheckpointError
from nystromformer.config import ConfigError, load_config
from nystromformer.pretrain import pretrain
from nystromformer.validate import validate

from helpers import tiny_config, write_model_dir, write_synthetic_data

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def trained(tmp_path):
    write_synthetic_data(tmp_path / "data")
    cfg = tiny_config()
    cfg["pretraining_setting"].update(epoch=2, learning_rate=3e-3, batches_per_epoch=25)
    folder = write_model_dir(tmp_path / "run", cfg)
    assert pretrain(load_config(folder), show_progress=False) == 0
    return folder


def test_every_unvalidated_checkpoint_is_validated_once_and_logged(trained):
    cfg = load_config(trained)
    first = validate(cfg)
    assert [e["checkpoint"] for e in first] == ["cp-0000.model", "cp-0001.model"]
    assert first[1]["loss"] < first[0]["loss"]
    assert validate(cfg) == []  # nothing new
    log = [json.loads(line) for line in (trained / "model" / "validation_output.log").read_text().splitlines()]
    assert [e["epoch"] for e in log] == [0, 1]
    assert all({"loss", "mlm_accu", "num_sequences"} <= set(e) for e in log)


def test_a_checkpoint_rewritten_by_a_new_run_is_validated_again_and_its_line_replaced(trained, capsys):
    # A fresh run in the same folder (the old cp-* and pretrain_output.log moved away, as pretraining asks) writes
    # other weights under the same names: the log's lines for the old weights must not count as done.
    cfg = load_config(trained)
    old = validate(cfg)
    for path in list((trained / "model").glob("cp-*")) + [trained / "model" / "pretrain_output.log"]:
        path.unlink()
    config = json.loads((trained / "config.json").read_text())
    config["pretraining_setting"]["learning_rate"] = 1e-2
    (trained / "config.json").write_text(json.dumps(config))
    assert pretrain(load_config(trained), show_progress=False) == 0
    capsys.readouterr()
    new = validate(load_config(trained))
    assert [e["checkpoint"] for e in new] == ["cp-0000.model", "cp-0001.model"]
    assert [e["fingerprint"] for e in new] != [e["fingerprint"] for e in old]
    assert capsys.readouterr().out.count("other weights under this name") == 2
    logged = [json.loads(line) for line in (trained / "model" / "validation_output.log").read_text().splitlines()]
    assert [(e["checkpoint"], e["loss"]) for e in logged] == [(e["checkpoint"], e["loss"]) for e in new]
    assert validate(load_config(trained)) == []


def test_a_measurement_on_another_number_of_sequences_is_kept_beside_the_full_one(trained):
    cfg = load_config(trained)
    (full,) = validate(cfg, epochs=[1])
    (quick,) = validate(cfg, epochs=[1], num_sequences=8)
    (again,) = validate(cfg, epochs=[1], num_sequences=8)  # the same measurement again replaces its line
    logged = [json.loads(line) for line in (trained / "model" / "validation_output.log").read_text().splitlines()]
    assert [(e["checkpoint"], e["num_sequences"]) for e in logged] == [("cp-0001.model", full["num_sequences"]),
                                                                       ("cp-0001.model", 8)]
    assert full["num_sequences"] != 8 and again["loss"] == quick["loss"]


def test_a_checkpoint_named_twice_is_measured_once(trained):
    entries = validate(load_config(trained), epochs=[0, 0])
    assert [e["checkpoint"] for e in entries] == ["cp-0000.model"]
    assert len((trained / "model" / "validation_output.log").read_text().splitlines()) == 1


def test_validation_matches_the_end_of_epoch_dev_evaluation(trained):
    cfg = load_config(trained)
    (entry,) = validate(cfg, epochs=[1])
    dev = [json.loads(line) for line in (trained / "model" / "pretrain_output.log").read_text().splitlines()
           if json.loads(line)["type"] == "dev"]
    assert entry["loss"] == pytest.approx(dev[1]["loss"], abs=1e-6)


def test_entries_of_an_earlier_dev_evaluation_are_measured_again_and_resuming_over_them_warns(trained, capsys):
    # Before 2026-11-23 a dev evaluation took the split's first rows (one corpus): not comparable with today's.
    cfg = load_config(trained)
    log = trained / "model" / "validation_output.log"
    first = validate(cfg)
    assert all(e["eval_version"] == 2 for e in first)
    old = [{k: v for k, v in json.loads(line).items() if k != "eval_version"} for line in log.read_text().splitlines()]
    log.write_text("".join(json.dumps(e) + "\n" for e in old))  # as validate wrote them before the record
    capsys.readouterr()
    again = validate(cfg)
    assert [e["checkpoint"] for e in again] == ["cp-0000.model", "cp-0001.model"]
    assert "2 entries were measured by an earlier dev evaluation" in capsys.readouterr().err
    assert len(log.read_text().splitlines()) == 4  # the old entries stay, the new ones beside them
    capsys.readouterr()
    assert validate(cfg) == []  # now measured with this evaluation, and no more warning about the old entries
    assert "earlier dev evaluation" not in capsys.readouterr().err
    # pretraining's own dev points: resuming over older ones says so
    pretrain_log = trained / "model" / "pretrain_output.log"
    entries = [json.loads(line) for line in pretrain_log.read_text().splitlines()]
    pretrain_log.write_text("".join(json.dumps({k: v for k, v in e.items() if k != "eval_version"}) + "\n"
                                    for e in entries))
    capsys.readouterr()
    assert pretrain(load_config(trained), show_progress=False) == 0  # (finished: it only reads the log)
    assert "2 dev point(s) were measured by an earlier dev evaluation" in capsys.readouterr().err


def test_a_missing_checkpoint_is_an_error_listing_the_available_ones(trained):
    with pytest.raises(CheckpointError, match="no checkpoint cp-0007.model .* available checkpoints: 0, 1"):
        validate(load_config(trained), epochs=[7])


def test_command_line_entry_points_agree(trained):
    script = subprocess.run([sys.executable, str(REPO / "code" / "run_validation.py"), "--model-dir", str(trained),
                             "--checkpoint", "0"], capture_output=True, text=True)
    assert script.returncode == 0, script.stderr
    cli = subprocess.run([sys.executable, "-m", "nystromformer.cli", "validate", "--model-dir", str(trained),
                          "--checkpoint", "0"], capture_output=True, text=True, cwd=REPO / "code")
    assert cli.returncode == 0, cli.stderr
    assert script.stdout.splitlines()[0] == cli.stdout.splitlines()[0]  # "cp-0000.model: dev loss ..."
    assert "replaces its earlier line in validation_output.log" in cli.stdout and "the same weights" in cli.stdout
    (line,) = (trained / "model" / "validation_output.log").read_text().splitlines()
    assert json.loads(line)["checkpoint"] == "cp-0000.model"


def test_dev_masks_do_not_depend_on_the_micro_batch_size(trained):
    cfg = load_config(trained)
    small = validate(cfg, epochs=[1], num_sequences=24)[0]
    cfg.gpu_setting.inst_per_gpu = 5
    other = validate(cfg, epochs=[1], num_sequences=24)[0]
    assert small["num_masked"] == other["num_masked"]
    # (the loss moves a little: Nyström's "original" pinv init scales by a maximum over the forward batch)
    assert small["loss"] == pytest.approx(other["loss"], rel=1e-5)


def test_fewer_than_one_dev_sequence_is_refused_and_nothing_is_logged(tmp_path):
    write_synthetic_data(tmp_path / "data")
    folder = write_model_dir(tmp_path / "run", tiny_config())
    with pytest.raises(ConfigError, match="--num-sequences: must be >= 1, got 0"):
        validate(load_config(folder), epochs=[0], num_sequences=0)
    assert not (folder / "model" / "validation_output.log").exists()


def test_with_fp16_a_validation_that_overflows_is_measured_again_in_fp32(trained, monkeypatch):
    # As pretraining's dev evaluation: fp16 (GPUs without bf16; CPU autocast has it too) can overflow on a dev batch.
    import dataclasses

    import torch

    import nystromformer.validate as validation
    from nystromformer.model import NystromformerForMaskedLM
    setup = validation.setup_runtime
    monkeypatch.setattr(validation, "setup_runtime", lambda mixed_precision, device=None: dataclasses.replace(
        setup(mixed_precision, device), autocast_dtype=torch.float16))
    forward = NystromformerForMaskedLM.forward

    def overflow_in_fp16(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return dataclasses.replace(out, loss_sum=out.loss_sum * float("inf")) if torch.is_autocast_enabled("cpu") \
            else out
    monkeypatch.setattr(NystromformerForMaskedLM, "forward", overflow_in_fp16)
    entries = validate(load_config(trained), [1])
    assert entries[0]["precision"] == "fp32 (fp16 overflowed)" and entries[0]["loss"] < 10


@pytest.mark.parametrize("section, key, value", [("model", "num_landmarks", 4), ("model", "attn_type", "softmax"),
                                                 ("pretraining_setting", "mask_prob", 0.5),
                                                 ("pretraining_setting", "seed", 4)])  # the dev masks come from it
def test_a_config_edited_after_training_is_refused_not_validated_as_another_model(trained, section, key, value):
    config = json.loads((trained / "config.json").read_text())
    old = load_config(trained).to_dict()[section][key]
    config[section][key] = value
    (trained / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"{section}\.{key}: is {json.dumps(value)} but cp-0000.model was "
                                          rf"trained with {json.dumps(old)}"):
        validate(load_config(trained), epochs=[0])
    assert not (trained / "model" / "validation_output.log").exists()


def test_a_setting_that_does_not_change_the_figures_may_differ(trained):
    config = json.loads((trained / "config.json").read_text())
    config["gpu_setting"]["inst_per_gpu"] = 4
    config["pretraining_setting"]["validate_batches_per_epoch"] = 1
    (trained / "config.json").write_text(json.dumps(config))
    assert len(validate(load_config(trained), epochs=[0])) == 1


def test_validating_a_model_folder_that_was_never_pretrained_is_an_error(tmp_path):
    write_synthetic_data(tmp_path / "data")
    folder = write_model_dir(tmp_path / "run", tiny_config())
    with pytest.raises(CheckpointError, match=r"no checkpoint cp-NNNN.model in .*: nothing has been pretrained"):
        validate(load_config(folder))


def pretrained_for_one_epoch(tmp_path, **settings):
    write_synthetic_data(tmp_path / "data")
    cfg = tiny_config()
    cfg["pretraining_setting"].update({"epoch": 1, **settings})
    folder = write_model_dir(tmp_path / "run", cfg)
    assert pretrain(load_config(folder), show_progress=False) == 0
    return folder


def test_validation_draws_the_runs_own_dev_masks_from_its_seed(tmp_path):
    folder = pretrained_for_one_epoch(tmp_path, seed=3)
    [entry] = validate(load_config(folder))
    [dev] = [e for e in map(json.loads, (folder / "model" / "pretrain_output.log").read_text().splitlines())
             if e["type"] == "dev"]
    assert entry["loss"] == pytest.approx(dev["loss"], abs=1e-6)


def test_a_run_without_dev_batches_is_validated_on_one_batch(tmp_path):
    folder = pretrained_for_one_epoch(tmp_path, validate_batches_per_epoch=0)
    [entry] = validate(load_config(folder))
    assert entry["num_sequences"] == 16 and entry["num_masked"] > 0 and entry["loss"] > 0


def test_a_checkpoint_whose_weights_diverged_is_named_in_an_error_and_kept_out_of_the_json_log(tmp_path):
    # A diverged run leaves such checkpoints behind (its error names them) and `validate` takes every checkpoint
    # not yet validated: a NaN dev loss must not reach the log (strict JSON, like pretraining's: jq, JavaScript),
    # nor an "MLM accuracy" taken from NaN scores; the healthy checkpoints are still validated and logged.
    import torch

    from nystromformer import atomic
    from nystromformer.errors import UserError
    folder = pretrained_for_one_epoch(tmp_path, epoch=2)
    cp = folder / "model" / "cp-0000.model"
    state = torch.load(cp, weights_only=True)
    state["model_state_dict"]["encoder.embeddings.word_embeddings.weight"][10] = float("nan")  # one word diverged
    atomic.torch_save(cp, state)
    with pytest.raises(UserError, match=r"cp-0000.model in .*: the dev loss is not finite \(the weights diverged\); "
                                        r"not written to validation_output.log, the other 1 checkpoint\(s\) were"):
        validate(load_config(folder))
    lines = (folder / "model" / "validation_output.log").read_text().splitlines()
    entries = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the JSON log")) for line in lines]
    assert [e["checkpoint"] for e in entries] == ["cp-0001.model"]
    # Not logged, so a later run tries it again (and says the same) rather than taking it as validated
    with pytest.raises(UserError, match=r"^cp-0000.model in .*not written to validation_output.log$"):
        validate(load_config(folder))


def test_validation_reports_the_commonest_token_bar_and_says_when_a_model_does_not_clear_it(trained, capsys):
    from collections import Counter

    import numpy as np
    import torch

    from nystromformer import atomic
    from nystromformer.mlm import STREAM_DEV_MASK, dev_sample, generator, mask_tokens
    from nystromformer.shards import ShardedSequences
    cfg = load_config(trained)
    ps = cfg.pretraining_setting
    (first,) = validate(cfg, epochs=[1], num_sequences=32)
    # The bar: always predicting the commonest token of the (fixed) dev masks, counted here from those masks
    dev = ShardedSequences(cfg.data_dir, "dev")
    counts = Counter()
    for row in dev_sample(len(dev), 32, ps.seed).tolist():
        ids = torch.from_numpy(dev.rows(np.array([row])))
        _, labels = mask_tokens(ids, generator(ps.seed, STREAM_DEV_MASK, row), ps.mask_prob,
                                dev.meta["special_tokens"], dev.meta["vocab_size"])
        counts.update(labels[labels != -100].tolist())
    masked = sum(counts.values())
    bar = counts.most_common(1)[0][1] / masked
    assert first["num_masked"] == masked and first["commonest_token_accu"] == bar
    # A model that predicts one token everywhere scores that token's share: the bar for the commonest one, less
    # for another; either way the console says it has not cleared the bar.
    path = trained / "model" / "cp-0001.model"
    weights = torch.load(path, weights_only=True)
    for token, count in (counts.most_common()[0], counts.most_common()[-1]):
        state = {**weights, "model_state_dict": dict(weights["model_state_dict"])}
        state["model_state_dict"]["mlm_head.bias"] = weights["model_state_dict"]["mlm_head.bias"].clone()
        state["model_state_dict"]["mlm_head.bias"][token] = 1e4
        atomic.torch_save(path, state)
        capsys.readouterr()
        (collapsed,) = validate(cfg, epochs=[1], num_sequences=32)
        assert collapsed["mlm_accu"] == count / masked and collapsed["commonest_token_accu"] == bar
        assert (f"MLM accuracy {count / masked:.4f} (commonest token: {bar:.4f}; no better than always predicting "
                f"it: the model has not learnt, or has collapsed, to one token), 32 sequences") in \
            capsys.readouterr().out
    logged = [json.loads(line) for line in (trained / "model" / "validation_output.log").read_text().splitlines()]
    # one line for the checkpoint, its latest measurement (each rewrite of the file replaced the line before)
    assert [(e["checkpoint"], e["mlm_accu"], e["commonest_token_accu"]) for e in logged] == [
        ("cp-0001.model", counts.most_common()[-1][1] / masked, bar)]


def test_a_checkpoint_folder_validation_cannot_write_to_is_refused_before_any_evaluation(trained, monkeypatch):
    import os

    from nystromformer import atomic
    from nystromformer.errors import UserError
    folder = trained / "model"
    access = os.access  # the root user passes permission checks: the file system's answer is stood in for here
    monkeypatch.setattr(atomic.os, "access", lambda p, mode: False if Path(p) == folder else access(p, mode))
    with pytest.raises(UserError, match=f"^validation_output.log cannot be written to {folder}: {folder} is not "
                                        f"writable by this user"):
        validate(load_config(trained))
    assert not (folder / "validation_output.log").exists()


def test_entries_logged_before_fingerprints_count_by_name_and_a_remeasurement_replaces_every_line_of_it(trained):
    # Lines of this dev evaluation written between 2026-11-23 and 2026-11-29 have no fingerprint; earlier versions
    # also appended a line per measurement, so a checkpoint may have several.
    cfg = load_config(trained)
    log = trained / "model" / "validation_output.log"
    first = validate(cfg)
    legacy = [{k: v for k, v in e.items() if k != "fingerprint"} for e in first]
    log.write_text("".join(json.dumps(e) + "\n" for e in [legacy[0], legacy[1], legacy[0]]))
    assert validate(cfg) == []  # measured by this evaluation: done, by name
    assert [e["num_sequences"] for e in validate(cfg, epochs=[1], num_sequences=8)] == [8]  # kept beside the full one
    (again,) = validate(cfg, epochs=[0])  # measured again: one line for it, in place of both
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["checkpoint"], e["num_sequences"], "fingerprint" in e) for e in logged] == [
        ("cp-0000.model", again["num_sequences"], True), ("cp-0001.model", first[1]["num_sequences"], False),
        ("cp-0001.model", 8, True)]


def test_validation_matches_the_dev_evaluation_of_a_batch_smaller_than_a_micro_batch(tmp_path):
    # batch_size / processes below inst_per_gpu: pretraining's passes are that many rows; its dev evaluation ran
    # passes of that size too, validate's of pass_rows, so Nyström's "original" pinv init (a max over each
    # micro-batch of a pass) took its max over other rows, and the two measured the same checkpoint differently.
    write_synthetic_data(tmp_path / "data")
    cfg = tiny_config()
    cfg["pretraining_setting"].update(epoch=1, batch_size=4, batches_per_epoch=30, learning_rate=3e-3,
                                      validate_batches_per_epoch=4)
    cfg["gpu_setting"]["inst_per_gpu"] = 8
    folder = write_model_dir(tmp_path / "run", cfg)
    assert pretrain(load_config(folder), show_progress=False) == 0
    (entry,) = validate(load_config(folder), epochs=[0])
    (dev,) = [json.loads(line) for line in (folder / "model" / "pretrain_output.log").read_text().splitlines()
              if json.loads(line)["type"] == "dev"]
    assert entry["loss"] == pytest.approx(dev["loss"], rel=1e-12, abs=0)
