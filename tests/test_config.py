"""config.json: the paper's schema, validated on load with errors that name the key."""
import json
from pathlib import Path

import pytest

from nystromformer.config import ConfigError, config_from_dict, load_config
from nystromformer.model import NystromformerForMaskedLM

from helpers import tiny_config

REPO = Path(__file__).resolve().parents[1]


def with_change(section, key, value):
    cfg = tiny_config()
    (cfg[section] if section else cfg)[key] = value
    return cfg


@pytest.mark.parametrize("section,key,value,message", [
    ("model", "num_landmark", 64, "model.num_landmark: unknown key"),
    ("model", "inv_init_coeff_option", "exact", "model.inv_init_coeff_option: unknown key"),  # the paper's typo
    ("pretraining_setting", "batch_size", "256", "pretraining_setting.batch_size: expected an integer"),
    ("pretraining_setting", "batch_size", 32.0, "pretraining_setting.batch_size: expected an integer"),
    ("model", "mixed_precision", 1, "model.mixed_precision: expected true/false"),
    ("model", "num_layers", True, "model.num_layers: expected an integer"),
    ("model", "head_dim", 16, "model.head_dim: num_head (4) x head_dim (16) = 64 must equal transformer_dim (32)"),
    ("model", "attn_type", "linformr", "model.attn_type: must be one of"),
    ("model", "conv_kernel_size", 4, "model.conv_kernel_size: must be a positive odd number"),
    ("model", "inv_coeff_init_option", "fast", "model.inv_coeff_init_option: must be one of original, exact"),
    ("model", "dropout_prob", 1.5, "model.dropout_prob: must be in [0, 1)"),
    ("pretraining_setting", "warmup", 0, "pretraining_setting.warmup"),
    ("gpu_setting", "inst_per_gpu", 0, "gpu_setting.inst_per_gpu: must be >= 1"),
    ("gpu_setting", "rows_per_pass", 12, "gpu_setting.rows_per_pass: must be a positive multiple of inst_per_gpu (8), "
                                         "or null for inst_per_gpu itself; got 12"),
    ("gpu_setting", "rows_per_pass", -8, "gpu_setting.rows_per_pass: must be a positive multiple of inst_per_gpu"),
    ("gpu_setting", "compile", "fast", "gpu_setting.compile: must be one of none, default, reduce-overhead"),
    (None, "data_dir", "x", "data_dir: unknown key"),
    (None, "model", [1, 2], "model: expected an object"),
    ("pretraining_setting", "learning_rate", float("inf"), "learning_rate: must be a finite number, got Infinity"),
    ("model", "dropout_prob", float("nan"), "model.dropout_prob: must be a finite number, got NaN"),
    ("pretraining_setting", "max_grad_norm", 10 ** 400, "max_grad_norm: must be a finite number, got an integer of 401 "
                                                        "digits"),  # beyond float: OverflowError, not this line
    (None, "from_cp", "", "from_cp: must be a non-empty path, or null"),
    ("pretraining_setting", "seed", -1, "pretraining_setting.seed: must be in [0, 2^63) (torch's seeds), got -1"),
    ("pretraining_setting", "seed", 2 ** 70, "pretraining_setting.seed: must be in [0, 2^63)"),
    ("model", "num_layers", 0, "model.num_layers: must be >= 1, got 0"),
    ("model", "num_landmarks", 0, "model.num_landmarks: must be >= 1, got 0"),
    ("model", "pinv_iterations", 0, "model.pinv_iterations: must be >= 1, got 0"),
    ("model", "dropout_prob", 1.0, "model.dropout_prob: must be in [0, 1), got 1.0"),
    ("model", "pad_token_id", 64, "model.pad_token_id: must be a token id below vocab_size (64), got 64"),
    ("model", "max_seq_len", 2 ** 20 + 1, "model.max_seq_len: must be <= 1048576"),
    ("model", "layer_norm_eps", 0, "model.layer_norm_eps: must be > 0"),
    ("pretraining_setting", "mask_prob", 0, "pretraining_setting.mask_prob: must be in (0, 1), got 0"),
    ("pretraining_setting", "mask_prob", 1, "pretraining_setting.mask_prob: must be in (0, 1), got 1"),
    ("pretraining_setting", "keep_resume_checkpoints", 0,
     "pretraining_setting.keep_resume_checkpoints: must be >= 1 (or null to keep all), got 0"),
    ("pretraining_setting", "max_grad_norm", 0, "pretraining_setting.max_grad_norm: must be > 0 (or null"),
    ("pretraining_setting", "warmup", 1, "pretraining_setting.warmup: is the fraction of steps"),
    ("pretraining_setting", "adam_eps", 0, "pretraining_setting.adam_eps: must be > 0"),
])
def test_bad_values_are_rejected_with_the_key_named(section, key, value, message):
    with pytest.raises(ConfigError, match=None) as err:
        config_from_dict(with_change(section, key, value))
    assert message in str(err.value)


def test_the_papers_released_config_layout_loads_once_its_two_keys_of_its_own_are_removed():
    # The authors' nystrom-512/config.json, key for key: a WikiHop folder and model.seq_len are theirs alone. Each is
    # refused with what to do, not as a bare unknown key; without them the file is valid here.
    released = {
        "model_checkpoints": "/model/model", "data_folder": "/dataset", "glue_dataset_folder": "/glue",
        "wikihop_dataset_folder": "/wikihop",
        "model": {"mixed_precision": True, "attention_grad_checkpointing": False, "gelu_grad_checkpointing": True,
                  "vocab_size": 50265, "num_sen_type": 1, "max_seq_len": 512, "embedding_dim": 768,
                  "transformer_dim": 768, "transformer_hidden_dim": 3072, "num_layers": 12, "dropout_prob": 0.1,
                  "num_head": 12, "head_dim": 64, "attn_type": "nystrom", "num_landmarks": 512, "seq_len": 64,
                  "conv_kernel_size": 33},
        "pretraining_setting": {"batch_size": 256, "learning_rate": 0.0001, "warmup": 0.01, "batches_per_report": 10,
                                "batches_per_epoch": 5000, "epoch": 100, "validate_batches_per_epoch": 100},
        "gpu_setting": {"inst_per_gpu": 8},
    }
    with pytest.raises(ConfigError, match=r"^wikihop_dataset_folder: .*no WikiHop task; remove the key$"):
        config_from_dict(released)
    del released["wikihop_dataset_folder"]
    with pytest.raises(ConfigError, match=r"^model.seq_len: .*max_seq_len is the one length .*check num_landmarks"):
        config_from_dict(released)
    del released["model"]["seq_len"]
    cfg = config_from_dict(released)
    assert (cfg.model.max_seq_len, cfg.model.num_landmarks, cfg.model.conv_kernel_size) == (512, 512, 33)


def test_errors_from_files_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(with_change("model", "num_head", -1)))
    with pytest.raises(ConfigError, match=r"config.json: model.num_head: must be >= 1"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model": {,}}')
    with pytest.raises(ConfigError, match=r"not valid JSON \(line 1"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{\n"model": {"attn_type": "nystr\xf6m"}}')  # Latin-1, not UTF-8
    with pytest.raises(ConfigError, match=r"config.json: not UTF-8 \(line 2"):
        load_config(tmp_path)

def test_a_missing_model_folder_or_config_file_is_named_for_what_it_is(tmp_path):
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'elsewhere'}: no such model folder$"):
        load_config(tmp_path / "elsewhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'empty'}: no config.json in this model folder$"):
        load_config(tmp_path / "empty")
    with pytest.raises(ConfigError, match=f"^no config file at {tmp_path / 'other.json'}$"):
        load_config(tmp_path / "other.json")


def test_a_reformer_bucket_longer_than_the_sequence_is_rejected():
    with pytest.raises(ConfigError, match=r"model.reformer_bucket_size: must be <= max_seq_len \(32\), got 64"):
        config_from_dict(tiny_config(attn_type="reformer", reformer_bucket_size=64, num_landmarks=64))


def test_non_finite_numbers_in_the_file_are_rejected_with_the_key_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()).replace('"learning_rate": 0.002',
                                                                            '"learning_rate": Infinity'))
    with pytest.raises(ConfigError, match=r"config.json: pretraining_setting.learning_rate: must be a finite number, "
                                          r"got Infinity"):
        load_config(tmp_path)


def test_a_key_given_twice_is_rejected_with_the_key_and_file_named(tmp_path):
    text = json.dumps(tiny_config(), indent=2).replace('"epoch": 3,', '"epoch": 3, "epoch": 30,')
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=r"config.json: pretraining_setting.epoch: appears more than once"):
        load_config(tmp_path)


def test_missing_keys_take_the_paper_defaults():
    cfg = config_from_dict({"model": {"attn_type": "nystrom"}})
    assert (cfg.model.num_landmarks, cfg.model.pinv_iterations, cfg.model.inv_coeff_init_option) == (64, 6, "original")
    assert (cfg.pretraining_setting.batch_size, cfg.pretraining_setting.learning_rate) == (256, 1e-4)
    assert cfg.model.conv_kernel_size is None
    # Most of these are not in the shipped nystrom-512: its run takes the defaults, so they must be the paper's.
    ps = cfg.pretraining_setting
    assert (ps.mask_prob, ps.weight_decay, ps.adam_eps, ps.warmup, ps.max_grad_norm, ps.seed) == \
        (0.15, 0.01, 1e-6, 0.01, None, 0)
    assert (cfg.model.layer_norm_eps, cfg.model.dropout_prob, cfg.model.vocab_size, cfg.model.pad_token_id) == \
        (1e-5, 0.1, 50265, 1)
    assert cfg.model.attention_fp32 and cfg.model.mixed_precision and not cfg.model.pre_layer_norm


def test_a_path_may_start_at_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "config.json").write_text(json.dumps({**tiny_config(), "data_folder": "~/data/512"}))
    assert load_config(tmp_path).data_dir == tmp_path / "home" / "data" / "512"


def test_paths_are_relative_to_the_model_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    cfg = load_config(tmp_path)
    assert cfg.checkpoint_dir == tmp_path / "model"
    assert cfg.data_dir == tmp_path / "../data"
    cfg.data_folder = "/abs/data"
    assert cfg.data_dir == Path("/abs/data")


@pytest.mark.parametrize("folder", ["nystrom-512", "nystrom-4096", "softmax-512"])
def test_shipped_model_folders_load_and_validate(folder):
    cfg = load_config(REPO / folder)
    assert cfg.model.max_seq_len in (512, 4096)
    assert cfg.model.num_head * cfg.model.head_dim == cfg.model.transformer_dim


def test_shipped_nystrom_512_has_the_paper_settings_with_landmarks_and_length_the_right_way_round():
    cfg = load_config(REPO / "nystrom-512")
    m, p = cfg.model, cfg.pretraining_setting
    assert (m.num_landmarks, m.max_seq_len, m.num_layers, m.transformer_dim) == (64, 512, 12, 768)
    assert m.conv_kernel_size is not None and m.attn_type == "nystrom"
    assert (p.batch_size, p.learning_rate, p.warmup, p.epoch, p.batches_per_epoch) == (256, 1e-4, 0.01, 100, 5000)


def test_nystrom_4096_warm_starts_from_the_last_nystrom_512_checkpoint():
    long, short = load_config(REPO / "nystrom-4096"), load_config(REPO / "nystrom-512")
    source = long.path(long.from_cp).resolve()
    last_epoch = short.pretraining_setting.epoch - 1
    assert source == (short.checkpoint_dir / f"cp-{last_epoch:04d}.model").resolve()
    assert long.model.max_seq_len % short.model.max_seq_len == 0
    # Same architecture apart from length: the 512 weights fit once positions are tiled.
    assert {k: v for k, v in vars(long.model).items() if k != "max_seq_len"} == \
           {k: v for k, v in vars(short.model).items() if k != "max_seq_len"}


def test_a_valid_config_builds_a_model():
    cfg = config_from_dict(tiny_config())
    model = NystromformerForMaskedLM(cfg.model)
    assert model.encoder.embeddings.position_embeddings.num_embeddings == cfg.model.max_seq_len + 2


def test_every_schema_key_is_documented():
    import dataclasses

    from nystromformer.config import Config
    doc = (REPO / "docs" / "config.md").read_text()
    sections = {"model": None, "pretraining_setting": None, "gpu_setting": None}
    for f in dataclasses.fields(Config):
        if f.metadata.get("internal"):
            continue
        if f.name in sections:
            for sub in dataclasses.fields(f.default_factory()):
                assert f"| `{sub.name}` |" in doc, f"{f.name}.{sub.name} is not in docs/config.md"
        else:
            assert f"| `{f.name}` |" in doc, f"{f.name} is not in docs/config.md"
