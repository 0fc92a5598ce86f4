"""The files the pipeline writes and reads back: atomic writes, checkpoints (no unpickling, the epoch's .cp written
last), shards (dtype by vocabulary size, ids below it, rows as the index lists them)."""
import json
import os

import numpy as np
import pytest
import torch

from nystromformer import atomic, checkpoint, shards
from nystromformer.shards import ShardedSequences, ShardError

from helpers import SPECIAL, write_synthetic_data


class NotATensor:
    """Any class: a pickle of it would run code on load."""


def test_a_failed_write_leaves_the_previous_file_whole_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "cp-0000.model"
    atomic.torch_save(path, {"model_state_dict": {"w": torch.ones(3)}})
    before = path.read_bytes()

    def torch_save_then_fail(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torch_save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        atomic.torch_save(path, {"model_state_dict": {"w": torch.zeros(3)}})
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["cp-0000.model"]


def test_a_write_reaches_the_disk_before_it_replaces_the_old_file(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.path.basename(os.readlink(
        f"/proc/self/fd/{fd}")))), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", os.path.basename(dst))),
                                                         replace(src, dst))[1])
    atomic.write_json(tmp_path / "result.json", {"score": 1})
    [(_, temporary), replaced, (_, folder)] = events  # the file, its rename, then the folder holding the rename
    assert temporary.startswith(".result.json.") and replaced == ("replace", "result.json")
    assert folder == tmp_path.name
    assert json.loads((tmp_path / "result.json").read_text()) == {"score": 1}


def test_a_checkpoint_holding_a_pickled_object_is_refused_not_unpickled(tmp_path):
    path = tmp_path / "cp-0000.model"
    torch.save({"model_state_dict": {"w": torch.ones(1)}, "extra": NotATensor()}, path)
    message = r"cp-0000.model: unreadable checkpoint: it holds a Python object \(test_files.NotATensor\)"
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load(path)


def test_a_file_torch_wrote_that_is_no_checkpoint_is_named_as_such(tmp_path):
    torch.save({"weights": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(checkpoint.CheckpointError, match=r"other.pt: not a checkpoint of this project"):
        checkpoint.load(tmp_path / "other.pt")


def test_an_epoch_writes_its_weights_before_its_resume_file_and_retires_older_step_files(tmp_path, monkeypatch):
    # The .cp marks the epoch complete: written last, a crash in between leaves no .cp without its .model.
    (tmp_path / "step-00000003.cp").write_bytes(b"x")  # from a stop earlier in this epoch
    (tmp_path / "step-00000009.cp").write_bytes(b"x")  # a later one (kept: not older than this checkpoint)
    written = []
    save = atomic.torch_save
    monkeypatch.setattr(atomic, "torch_save", lambda path, obj: (written.append(path.name), save(path, obj))[1])
    state = {"model_state_dict": {"w": torch.ones(1)}, "step": 4, "config": None}
    checkpoint.save_epoch(tmp_path, 0, state)
    assert written == ["cp-0000.model", "cp-0000.cp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cp-0000.cp", "cp-0000.model", "step-00000009.cp"]
    assert checkpoint.load(tmp_path / "cp-0000.model")["epoch"] == 0


@pytest.mark.parametrize("vocab_size, dtype", [(50265, np.uint16), (65536, np.uint16), (65537, np.uint32)])
def test_shards_take_the_smallest_dtype_that_holds_every_id(tmp_path, vocab_size, dtype):
    meta = shards.make_meta(4, vocab_size, "test", SPECIAL)
    assert np.dtype(meta["dtype"]) == dtype
    top = np.array([[0, 1, vocab_size - 1, 2]])
    shards.write_meta(tmp_path, meta)
    shards.write_shard(tmp_path / "train-00000.npy", top, meta)
    shards.write_split_index(tmp_path, "train", ["train-00000.npy"])
    assert ShardedSequences(tmp_path, "train").rows([0]).tolist() == top.tolist()  # the top id is not wrapped


@pytest.mark.parametrize("bad_id", [64, -1])
def test_a_shard_with_an_id_outside_the_vocabulary_is_not_written(tmp_path, bad_id):
    meta = shards.make_meta(4, 64, "test", SPECIAL)
    with pytest.raises(ShardError, match=r"train-00000.npy: token ids must lie in \[0, 64\)"):
        shards.write_shard(tmp_path / "train-00000.npy", np.array([[0, 5, bad_id, 2]]), meta)
    assert not (tmp_path / "train-00000.npy").exists()


def test_a_shard_whose_rows_differ_from_its_index_entry_is_an_error_naming_both(tmp_path):
    write_synthetic_data(tmp_path, num_train=200, shard_size=100)
    index = json.loads((tmp_path / "train.json").read_text())
    index["shards"][1]["num_sequences"] = 90  # e.g. a shard rebuilt without its index
    (tmp_path / "train.json").write_text(json.dumps(index))
    with pytest.raises(ShardError, match=r"train-00001.npy: shape \(100, 32\) does not match .*train.json "
                                         r"\(90 x 32\)"):
        ShardedSequences(tmp_path, "train")


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.pop("dtype"), r'meta.json: dtype: expected "uint16" or "uint32", got null'),
    (lambda m: m.update(dtype="int17"), r'meta.json: dtype: expected "uint16" or "uint32", got "int17"'),
    (lambda m: m.pop("max_seq_len"), r"meta.json: max_seq_len: expected a positive integer, got null"),
    (lambda m: m.update(vocab_size="64"), r'meta.json: vocab_size: expected a positive integer, got "64"'),
    (lambda m: m["special_tokens"].pop("mask"), r"meta.json: special_tokens: mask missing, or not a token id below "
                                                r"vocab_size \(64\)"),
    (lambda m: m.update(special_tokens=[1, 2]), r"meta.json: special_tokens: expected an object with bos, eos"),
])
def test_a_hand_edited_meta_json_is_an_error_naming_the_file_and_key(tmp_path, edit, says):
    write_synthetic_data(tmp_path)
    meta = json.loads((tmp_path / "meta.json").read_text())
    edit(meta)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ShardError, match=says):
        ShardedSequences(tmp_path, "train")


@pytest.mark.parametrize("entry", [{"name": "train-00000.npy", "num_sequences": 100}, "train-00000.npy",
                                   {"file": "train-00000.npy"}])
def test_a_hand_edited_split_index_entry_is_an_error_naming_the_file_and_entry(tmp_path, entry):
    write_synthetic_data(tmp_path, num_train=200, shard_size=100)
    index = json.loads((tmp_path / "train.json").read_text())
    index["shards"][0] = entry
    (tmp_path / "train.json").write_text(json.dumps(index))
    with pytest.raises(ShardError, match=r'train.json: shards\[0\]: expected \{"file": name, "num_sequences": n\}'):
        ShardedSequences(tmp_path, "train")


def test_an_entry_appended_after_a_torn_last_line_is_whole_and_the_fragment_is_removed(tmp_path, capsys):
    # A kill while the last line was written leaves it without its newline; the rerun's next entry must not be
    # glued onto it (both would be unreadable).
    from nystromformer import jsonlog
    log = tmp_path / "pretrain_output.log"
    whole = json.dumps({"type": "train", "step": 1}) + "\n"
    log.write_text(whole + '{"type": "dev", "epo')
    writer = jsonlog.JsonLog(log)
    writer.write(type="dev", epoch=0, step=1, loss=4.0)
    writer.write(type="train", step=2)
    assert "removed a torn last line (20 bytes: " in capsys.readouterr().err
    assert [e["type"] for e in jsonlog.read(log)] == ["train", "dev", "train"]
    assert capsys.readouterr().err == ""  # every line parses now
    log.write_text(whole)
    jsonlog.JsonLog(log).write(type="train", step=2)  # a whole last line is left as it is
    assert log.read_text() == whole + json.dumps({"type": "train", "step": 2}) + "\n"
    log.write_text(whole.rstrip("\n"))  # a whole entry without its newline (killed between the two) is kept
    jsonlog.JsonLog(log).write(type="train", step=2)
    assert [e["step"] for e in jsonlog.read(log)] == [1, 2]


def test_rewriting_the_training_log_on_resume_is_atomic(tmp_path, monkeypatch):
    from nystromformer import jsonlog
    log = tmp_path / "pretrain_output.log"
    log.write_text("".join(json.dumps({"type": "train", "step": s}) + "\n" for s in range(1, 5)))
    before = log.read_text()

    def disk_full(path, text):
        raise OSError("disk full")

    monkeypatch.setattr(atomic, "write_text", disk_full)
    with pytest.raises(OSError, match="disk full"):
        jsonlog.JsonLog(log).truncate_after(2)
    assert log.read_text() == before


def test_the_repair_of_a_torn_last_line_reaches_the_disk_before_the_next_entry_is_appended(tmp_path, monkeypatch):
    # Else a crash right after could leave the next entry glued onto the fragment after all.
    from nystromformer import jsonlog
    log = tmp_path / "pretrain_output.log"
    whole = json.dumps({"type": "train", "step": 1}) + "\n"
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append((os.path.basename(os.readlink(
        f"/proc/self/fd/{fd}")), log.read_text())), fsync(fd))[1])
    for torn, repaired in (('{"type": "dev", "epo', whole), ('{"type": "dev"}', whole + '{"type": "dev"}\n')):
        log.write_text(whole + torn)
        synced.clear()
        jsonlog.JsonLog(log).write(type="train", step=2)
        assert synced == [(log.name, repaired)]


def test_a_lock_file_names_only_its_holder_however_long_the_previous_holder_s_name_was(tmp_path):
    from nystromformer.errors import UserError
    path = tmp_path / "run.lock"
    path.write_text("a-much-longer-host-name.cluster.example pid 123456789\n")  # left by a run that ended
    with atomic.exclusive_lock(path, UserError, content="node-1 pid 7\n"):
        assert path.read_text() == "node-1 pid 7\n"
