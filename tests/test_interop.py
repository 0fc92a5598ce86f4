"""transformers interop: our model and transformers' Nyströmformer compute the same function where their
semantics coincide, export/import preserve weights, and options transformers cannot reproduce are refused."""
import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import tiny_config, write_model_dir  # noqa: E402
from nystromformer import atomic, checkpoint  # noqa: E402
from nystromformer.cli import main  # noqa: E402
from nystromformer.config import ModelConfig, config_from_dict, load_config  # noqa: E402
from nystromformer.interop import (InteropError, build_hf_model, check_exportable, export_hf,  # noqa: E402
                                   import_hf)
from nystromformer.model import NystromformerForMaskedLM, NystromformerForSequenceClassification  # noqa: E402

ATOL = 1e-5
SEQ = 32  # tiny_config's max_seq_len


def model_config(**overrides) -> ModelConfig:
    return config_from_dict(tiny_config(**overrides)).model


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights away from the init (non-zero biases, LayerNorm gains != 1), so every parameter matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name.lower() and name.endswith("weight") else 0.1 * noise)
    return model.eval()


def ours(seed=0, **overrides) -> NystromformerForMaskedLM:
    return randomize(NystromformerForMaskedLM(model_config(**overrides)), seed)


def token_ids(batch=2, n=SEQ, seed=1, vocab=64):
    return torch.randint(5, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


SETTINGS = {
    "softmax-equivalent (landmarks = length)": dict(num_landmarks=SEQ, conv_kernel_size=5),
    "nystrom with conv": dict(num_landmarks=8, conv_kernel_size=5),
    "nystrom without conv": dict(num_landmarks=8, conv_kernel_size=None),
    "attn_type softmax": dict(attn_type="softmax", conv_kernel_size=None),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_transformers_computes_our_function_on_unpadded_full_length_inputs(setting):
    model = ours(**SETTINGS[setting])
    hf = build_hf_model(model.config, model.state_dict())
    ids = token_ids()
    with torch.no_grad():
        hidden = model.encoder(ids)
        hf_hidden = hf.nystromformer(ids).last_hidden_state
        torch.testing.assert_close(hf_hidden, hidden, atol=ATOL, rtol=0)
        torch.testing.assert_close(hf(ids).logits, model.logits(ids), atol=ATOL, rtol=0)
        # an all-ones attention mask is the same as none, on both sides
        ones = torch.ones_like(ids)
        torch.testing.assert_close(hf(ids, attention_mask=ones).logits, model.logits(ids, ones), atol=ATOL, rtol=0)


def test_position_table_sizes_agree():
    model = ours()
    hf = build_hf_model(model.config, model.state_dict())
    assert hf.config.max_position_embeddings == SEQ
    assert hf.nystromformer.embeddings.position_embeddings.weight.shape[0] == SEQ + 2
    assert model.encoder.embeddings.position_embeddings.weight.shape[0] == SEQ + 2


def padded_batch():
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    ids[1, 20:] = 1
    return ids, mask


def test_padding_agrees_on_real_tokens_in_the_exact_path_without_conv():
    model = ours(num_landmarks=SEQ, conv_kernel_size=None)
    hf = build_hf_model(model.config, model.state_dict())
    ids, mask = padded_batch()
    with torch.no_grad():
        a, b = model.logits(ids, mask), hf(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(b[real], a[real], atol=ATOL, rtol=0)


def test_padding_differs_near_padding_with_conv_because_we_zero_padded_values():
    """Documented difference: we convolve V * mask, transformers convolves V including padded positions.
    One layer, so the difference stays where the conv window reaches the padding."""
    model = ours(num_landmarks=SEQ, conv_kernel_size=5, num_layers=1)
    hf = build_hf_model(model.config, model.state_dict())
    ids, mask = padded_batch()
    with torch.no_grad():
        a, b = model.logits(ids, mask), hf(ids, attention_mask=mask).logits
    diff = (a - b).abs().amax(dim=-1)
    assert diff[0].max() < ATOL                   # the unpadded row agrees
    assert diff[1, :18].max() < ATOL              # tokens further than kernel//2 from the padding agree
    assert diff[1, 18:20].min() > 1e-3            # the conv window of tokens 18, 19 reaches the padding


def test_transformers_nystrom_path_rejects_padding_masks_and_mixes_rows_of_short_inputs():
    """Documented transformers defects of the Nyström path (segment_means_seq_len is a fixed length)."""
    model = ours(num_landmarks=8, conv_kernel_size=5)
    hf = build_hf_model(model.config, model.state_dict())
    ids, mask = padded_batch()
    with torch.no_grad(), pytest.raises(RuntimeError):
        hf(ids, attention_mask=mask)
    # Shorter inputs: its reshape folds the batch into the segments, so row 0 depends on row 1.
    short = token_ids(n=16)
    other = short.clone()
    other[1] = token_ids(batch=1, n=16, seed=7)[0]
    with torch.no_grad():
        hf_changed = (hf(short).logits[0] - hf(other).logits[0]).abs().max()
        ours_changed = (model.logits(short)[0] - model.logits(other)[0]).abs().max()
        hf_vs_ours = (hf(short).logits - model.logits(short)).abs().max()
    assert hf_vs_ours > 1e-2
    # (ours depends on batch mates only through the batch-wide pinv init scale of init "original")
    assert hf_changed > 10 * ours_changed


def write_checkpoint(tmp_path, model, name="m", **config_extra):
    cfg = tiny_config(**{k: v for k, v in dataclasses.asdict(model.config).items()})
    cfg.update(config_extra)
    folder = write_model_dir(tmp_path / name, cfg)
    atomic.torch_save(folder / "model" / "cp-0000.model", {"model_state_dict": model.state_dict(), "epoch": 0,
                                                           "step": 4})
    return folder


@pytest.mark.parametrize("hidden_act, hf_act", [("gelu_tanh", "gelu_new"), ("gelu", "gelu")])
def test_export_loads_with_from_pretrained_and_gives_our_logits(tmp_path, hidden_act, hf_act):
    model = ours(num_landmarks=8, conv_kernel_size=5, hidden_act=hidden_act)
    folder = write_checkpoint(tmp_path, model)
    logs = []
    out = export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=logs.append)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert any("no tokenizer found" in line for line in logs)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "NystromformerForMaskedLM" and hf.config.hidden_act == hf_act
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.logits(ids), atol=ATOL, rtol=0)


def test_fill_mask_pipeline_runs_on_an_exported_model(tmp_path, shared_dir):
    tok_dir = shared_dir / "tokenizers" / "roberta-base"
    if not tok_dir.is_dir():
        pytest.skip(f"no tokenizer at {tok_dir}")
    model = ours(vocab_size=50265, num_landmarks=SEQ)
    folder = write_checkpoint(tmp_path, model, tokenizer=str(tok_dir))
    out = export_hf(load_config(folder), tmp_path / "hf", epoch=0)
    assert (out / "vocab.json").is_file() and (out / "merges.txt").is_file()
    fill = transformers.pipeline("fill-mask", model=str(out), tokenizer=str(out), device="cpu")
    text = "The capital of France is <mask>."
    predictions = fill(text)
    assert len(predictions) == 5 and all("<mask>" not in p["sequence"] for p in predictions)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    enc = tok(text, return_tensors="pt")
    position = (enc["input_ids"][0] == tok.mask_token_id).nonzero()[0, 0]
    with torch.no_grad():
        expected = model.logits(enc["input_ids"], enc["attention_mask"])[0, position].argmax().item()
    assert predictions[0]["token"] == expected


@pytest.mark.parametrize("conv", [5, None])
def test_export_then_import_is_identity_on_the_state_dict(tmp_path, conv):
    model = ours(num_landmarks=8, conv_kernel_size=conv)
    folder = write_checkpoint(tmp_path, model)
    export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=lambda s: None)
    target = import_hf(tmp_path / "hf", tmp_path / "back", log=lambda s: None)
    back = checkpoint.load(target)["model_state_dict"]
    original = model.state_dict()
    assert back.keys() == original.keys()
    for k in original:
        assert torch.equal(back[k], original[k]), k
    cfg = load_config(tmp_path / "back")
    assert cfg.model.conv_kernel_size == conv and cfg.model.num_landmarks == 8
    assert cfg.path(cfg.from_cp) == target


def hf_nystromformer(tmp_path, **kwargs):
    config = transformers.NystromformerConfig(**{**dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_act="gelu", max_position_embeddings=SEQ, segment_means_seq_len=SEQ, num_landmarks=8,
        conv_kernel_size=5, type_vocab_size=2), **kwargs})
    hf = randomize(transformers.NystromformerForMaskedLM(config))
    hf.save_pretrained(str(tmp_path / "hf-src"))
    return hf, tmp_path / "hf-src"


def load_imported(model_dir):
    cfg = load_config(model_dir)
    model = NystromformerForMaskedLM(cfg.model)
    model.load_state_dict(checkpoint.load(cfg.path(cfg.from_cp))["model_state_dict"])
    return model.eval()


@pytest.mark.parametrize("hf_act, ours", [("gelu", "gelu"), ("gelu_new", "gelu_tanh"),
                                          ("gelu_pytorch_tanh", "gelu_tanh")])
def test_import_of_a_transformers_model_gives_its_logits(tmp_path, hf_act, ours):
    # The released uw-madison checkpoints say gelu_new: the authors' tanh GELU, ours as hidden_act gelu_tanh
    hf, src = hf_nystromformer(tmp_path, hidden_act=hf_act)
    said = []
    import_hf(src, tmp_path / "ours", log=said.append)
    assert not [line for line in said if line.startswith("warning")]
    model = load_imported(tmp_path / "ours")
    assert model.config.num_sen_type == 2 and model.config.num_landmarks == 8 and model.config.hidden_act == ours
    ids = token_ids()
    types = torch.randint(0, 2, ids.shape)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids, None, types), hf(ids, token_type_ids=types).logits,
                                   atol=ATOL, rtol=0)


def test_import_keeps_the_other_sections_of_an_existing_config(tmp_path):
    _, src = hf_nystromformer(tmp_path)
    folder = write_model_dir(tmp_path / "ours", {**tiny_config(), "data_folder": "my-data"})
    import_hf(src, folder, log=lambda s: None)
    data = json.loads((folder / "config.json").read_text())
    assert data["data_folder"] == "my-data" and data["from_cp"] == "imported/hf-import.model"
    assert data["pretraining_setting"]["batches_per_epoch"] == 4


def test_import_refuses_a_folder_that_pretraining_would_resume(tmp_path):
    _, src = hf_nystromformer(tmp_path)
    folder = write_model_dir(tmp_path / "ours", tiny_config())
    atomic.torch_save(folder / "model" / "cp-0000.cp", {"model_state_dict": {}})
    with pytest.raises(InteropError, match="resumable checkpoints"):
        import_hf(src, folder, log=lambda s: None)


def test_released_config_with_landmarks_equal_to_segment_length_is_detected(tmp_path):
    """uw-madison/nystromformer-512 ships num_landmarks == segment_means_seq_len == 64 with 510 positions:
    transformers then runs exact softmax attention although the model was trained with 64 landmarks."""
    hf, src = hf_nystromformer(tmp_path, num_landmarks=8, segment_means_seq_len=8)
    logs = []
    import_hf(src, tmp_path / "paper", log=logs.append)
    assert load_config(tmp_path / "paper").model.num_landmarks == 8
    assert any("swapped" in line for line in logs)
    import_hf(src, tmp_path / "as-hf", match_transformers=True, log=lambda s: None)
    model = load_imported(tmp_path / "as-hf")
    assert model.config.num_landmarks == SEQ
    ids, mask = token_ids(n=20), None
    with torch.no_grad():  # transformers' exact path accepts any length: both compute softmax attention
        torch.testing.assert_close(model.logits(ids, mask), hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("overrides, option", [
    (dict(embedding_dim=16), "model.embedding_dim"),
    (dict(num_landmarks=6), "model.num_landmarks"),
    (dict(inv_coeff_init_option="exact"), "model.inv_coeff_init_option"),
    (dict(pinv_iterations=8), "model.pinv_iterations"),
    (dict(pre_layer_norm=True), "model.pre_layer_norm"),  # the LRA model: transformers' is post-LayerNorm
])
def test_export_refuses_options_transformers_computes_differently(tmp_path, capsys, overrides, option):
    model = ours(**overrides)
    folder = write_checkpoint(tmp_path, model)
    code = main(["export-hf", "--model-dir", str(folder), "--checkpoint", "0", "--output", str(tmp_path / "hf")])
    assert code == 2
    assert option in capsys.readouterr().err
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_export_refuses_other_attention_types():
    mc = dataclasses.replace(model_config(), attn_type="performer")
    with pytest.raises(InteropError, match="model.attn_type"):
        check_exportable(mc)


def test_options_unused_by_the_exact_path_do_not_block_export():
    notes = check_exportable(model_config(num_landmarks=SEQ, inv_coeff_init_option="exact", pinv_iterations=3))
    assert any("unused" in n for n in notes)


def test_transformers_exact_pinv_init_crashes():
    """The defect behind refusing inv_coeff_init_option='exact': a typo'd config key."""
    config = transformers.NystromformerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=4, intermediate_size=64, inv_coeff_init_option=True)
    with pytest.raises(TypeError):
        transformers.NystromformerModel(config)


@pytest.mark.parametrize("num_labels", [3, 1])
def test_glue_weights_export_as_sequence_classification(tmp_path, num_labels):
    mc = model_config(num_landmarks=8)
    model = randomize(NystromformerForSequenceClassification(mc, num_labels))
    folder = write_model_dir(tmp_path / "m", tiny_config(num_landmarks=8))
    weights = tmp_path / "best.model"
    task = {1: "STS-B", 2: "RTE", 3: "MNLI"}[num_labels]  # as GLUE's best.model records it
    atomic.torch_save(weights, {"model_state_dict": model.state_dict(), "num_labels": num_labels, "task": task,
                                "model_config": dataclasses.asdict(mc)})
    with pytest.raises(InteropError, match="--num-labels"):
        export_hf(load_config(folder), tmp_path / "x", glue_weights=weights, num_labels=num_labels + 1)
    (tmp_path / "hf").mkdir()  # an empty folder is a new one
    out = export_hf(load_config(folder), tmp_path / "hf", glue_weights=weights, log=lambda s: None)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "NystromformerForSequenceClassification" and hf.config.num_labels == num_labels
    if num_labels > 1:  # the task's label names, so that a transformers user knows which index means what
        assert list(hf.config.id2label.values()) == {2: ["entailment", "not_entailment"],
                                                     3: ["contradiction", "entailment", "neutral"]}[num_labels]
    assert all((path.stat().st_mode & 0o777) == 0o666 & ~atomic.current_umask() for path in out.iterdir())
    ids = token_ids()
    with torch.no_grad():
        expected = model(ids)
        got = hf(ids).logits
    torch.testing.assert_close(got.squeeze(-1) if num_labels == 1 else got, expected, atol=ATOL, rtol=0)


def hf_roberta(tmp_path, pad_token_id=1):
    # RoBERTa's positions run from pad_token_id + 1: SEQ of them after the pad's row
    config = transformers.RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=SEQ + pad_token_id + 1,
                                        type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=pad_token_id,
                                        hidden_act="gelu")
    roberta = randomize(transformers.RobertaForMaskedLM(config))
    roberta.save_pretrained(str(tmp_path / "roberta"))
    return roberta, tmp_path / "roberta"


@pytest.mark.parametrize("pad_token_id", [1, 0, 3])  # 1: RoBERTa's own; others number positions from elsewhere
def test_roberta_weights_initialise_a_softmax_model_that_computes_roberta(tmp_path, pad_token_id):
    roberta, src = hf_roberta(tmp_path, pad_token_id)
    logs = []
    import_hf(src, tmp_path / "ours", overrides={"attn_type": "softmax", "max_seq_len": SEQ}, log=logs.append)
    model = load_imported(tmp_path / "ours")
    assert any("positions start at row" in line for line in logs) == (pad_token_id != 1)
    ids = token_ids()  # no pad tokens: RoBERTa's positions are pad_token_id + 1 on, ours 2 on
    assert not (ids == pad_token_id).any()
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), roberta(ids).logits, atol=ATOL, rtol=0)


def test_roberta_import_tiles_positions_and_leaves_the_conv_at_init(tmp_path):
    roberta, src = hf_roberta(tmp_path)
    logs = []
    import_hf(src, tmp_path / "ours", overrides={"max_seq_len": 2 * SEQ, "num_landmarks": 8,
                                                  "conv_kernel_size": 5}, log=logs.append)
    model = load_imported(tmp_path / "ours")
    table = model.encoder.embeddings.position_embeddings.weight
    source = roberta.roberta.embeddings.position_embeddings.weight
    assert table.shape[0] == 2 * SEQ + 2
    assert torch.equal(table[2:SEQ + 2], source[2:]) and torch.equal(table[SEQ + 2:], source[2:])
    assert any("attention.attn.conv.weight" in line and "left at our initialisation" in line for line in logs)
    with pytest.raises(InteropError, match="multiple"):
        import_hf(src, tmp_path / "bad", overrides={"max_seq_len": 48, "num_landmarks": 8}, log=lambda s: None)


def test_an_untied_decoder_is_refused_rather_than_silently_replaced_by_the_embeddings(tmp_path):
    _, src = hf_nystromformer(tmp_path, tie_word_embeddings=False)
    with pytest.raises(InteropError, match=r"cls.predictions.decoder.weight differs from the word embeddings: .*"
                                           r"tie_word_embeddings false"):
        import_hf(src, tmp_path / "ours", log=lambda s: None)
    assert not (tmp_path / "ours" / "imported").exists()


def test_a_bad_value_in_a_transformers_config_is_named_by_its_own_key_and_our_folder_is_not_taken_for_one(
        tmp_path):
    from nystromformer.config import ConfigError
    _, src = hf_nystromformer(tmp_path)
    hf_config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf_config, "num_hidden_layers": "two"}))
    with pytest.raises(ConfigError, match=r"hf-src/config.json: num_hidden_layers \(read as model.num_layers\): "):
        import_hf(src, tmp_path / "ours", log=lambda s: None)
    ours_folder = write_model_dir(tmp_path / "ours-already", tiny_config())
    with pytest.raises(InteropError, match=r"ours-already: a model folder of this project, not a transformers "
                                           r"folder"):
        import_hf(ours_folder, tmp_path / "ours", log=lambda s: None)


def resave(src, dest, rename):
    """A copy of a transformers folder with its weights as pytorch_model.bin, keys renamed (None drops one)."""
    from safetensors.torch import load_file
    dest.mkdir()
    (dest / "config.json").write_text((src / "config.json").read_text())
    state = {rename(k): v for k, v in load_file(str(src / "model.safetensors")).items() if rename(k) is not None}
    torch.save(state, dest / "pytorch_model.bin")
    return dest


@pytest.mark.parametrize("damage", ["DDP prefix", "one layer's query missing"])
def test_weights_that_leave_encoder_parameters_random_are_refused(tmp_path, damage):
    _, src = hf_nystromformer(tmp_path)
    if damage == "DDP prefix":
        broken = resave(src, tmp_path / "bad", lambda k: "module." + k)
        expected = r"are not in the transformers weights, .* its keys start with module\.: saved from a wrapped model"
    else:
        broken = resave(src, tmp_path / "bad", lambda k: None if "layer.1.attention.self.query" in k else k)
        expected = (r"2 encoder weight\(s\) are not in the transformers weights, e.g. "
                    r"nystromformer.encoder.layer.1.attention.self.query.weight")
    with pytest.raises(InteropError, match=expected):
        import_hf(broken, tmp_path / "ours", log=lambda s: None)


def test_a_longer_max_seq_len_keeps_an_exact_attention_model_exact(tmp_path):
    hf, src = hf_nystromformer(tmp_path, num_landmarks=SEQ, conv_kernel_size=1)  # transformers' exact path
    logs = []
    import_hf(src, tmp_path / "ours", overrides={"max_seq_len": 2 * SEQ}, log=logs.append)
    model = load_imported(tmp_path / "ours")
    assert model.config.max_seq_len == model.config.num_landmarks == 2 * SEQ
    assert any("keeping it exact at max_seq_len 64" in line for line in logs)
    import_hf(src, tmp_path / "nystrom", overrides={"max_seq_len": 2 * SEQ, "num_landmarks": 8}, log=lambda s: None)
    assert load_imported(tmp_path / "nystrom").config.num_landmarks == 8  # asked for: Nystrom


def test_import_into_a_pre_layer_norm_folder_gives_the_post_layer_norm_model_it_reads(tmp_path):
    hf, src = hf_nystromformer(tmp_path)
    folder = write_model_dir(tmp_path / "ours", tiny_config(pre_layer_norm=True))
    logs = []
    import_hf(src, folder, log=logs.append)
    model = load_imported(folder)
    assert not model.config.pre_layer_norm and any("pre_layer_norm false" in line for line in logs)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_export_uses_the_model_settings_the_checkpoint_was_trained_with(tmp_path):
    model = ours(num_landmarks=8, conv_kernel_size=5)
    folder = write_checkpoint(tmp_path, model, name="trained")
    state = checkpoint.load(folder / "model" / "cp-0000.model")
    state["config"] = load_config(folder).to_dict()  # pretraining stores its config in the checkpoint
    atomic.torch_save(folder / "model" / "cp-0000.model", state)
    changed = json.loads((folder / "config.json").read_text())
    changed["model"]["conv_kernel_size"] = None  # edited after training
    (folder / "config.json").write_text(json.dumps(changed))
    logs = []
    out = export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=logs.append)
    assert any("conv_kernel_size 5 instead of None); exporting it as trained" in line for line in logs)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(out)).eval()
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.logits(ids), atol=ATOL, rtol=0)

    del state["config"]  # an older checkpoint: config.json is all there is, and it does not fit
    atomic.torch_save(folder / "model" / "cp-0000.model", state)
    with pytest.raises(InteropError, match=r"cp-0000.model: encoder.layers.0.attention.attn.conv.weight: not in the "
                                           r"model; the model settings .*conv_kernel_size None.* do not describe"):
        export_hf(load_config(folder), tmp_path / "hf2", epoch=0, log=lambda s: None)


def test_unreadable_transformers_folders_are_errors_naming_the_file(tmp_path, capsys):
    _, src = hf_nystromformer(tmp_path)
    (src / "model.safetensors").write_bytes(b"\xff" * 64)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["import-hf", "--input", str(src), "--model-dir", str(tmp_path / "ours")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {src / 'model.safetensors'}: unreadable weights")
    _, src = hf_nystromformer(tmp_path / "2")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["hidden_size"], cfg["model_type"]  # no model_type: no transformers defaults to fall back on
    (src / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["import-hf", "--input", str(src), "--model-dir", str(tmp_path / "ours")]) == 2
    assert "config.json: no hidden_size" in capsys.readouterr().err


def test_sharded_pytorch_model_bin_folders_import(tmp_path):
    hf, src = hf_nystromformer(tmp_path)
    from safetensors.torch import load_file
    state = load_file(str(src / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((src / "config.json").read_text())
    keys = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for name, part in halves.items():
        torch.save({k: state[k] for k in part}, sharded / name)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, part in halves.items() for k in part}}))
    import_hf(sharded, tmp_path / "ours", log=lambda s: None)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(load_imported(tmp_path / "ours").logits(ids), hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("flags, says", [
    (["--max-seq-len", "0"], "error: --max-seq-len 0: must be >= 1, got 0"),
    (["--max-seq-len", "100000000"], "error: --max-seq-len 100000000: must be <= 1048576"),
    (["--conv-kernel-size", "4"], "error: --conv-kernel-size 4: must be a positive odd number"),
])
def test_import_flags_with_impossible_values_are_named_as_the_flags_before_any_reading(tmp_path, capsys, flags,
                                                                                       says):
    assert main(["import-hf", "--input", str(tmp_path / "not-read"), "--model-dir", str(tmp_path / "ours"),
                 *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and len(err.splitlines()) == 1, err
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("content, says", [("{bad", "not valid JSON"), ("[1]", "expected a JSON object"),
                                           ('{"model": {"num_layers": "2"}}', "model.num_layers: expected an integer")])
def test_import_into_a_folder_whose_config_json_is_unusable_names_the_file(tmp_path, capsys, content, says):
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(content)
    assert main(["import-hf", "--input", str(tmp_path / "not-read"), "--model-dir", str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'ours' / 'config.json'}: ") and says in err, err


def test_export_flags_that_would_be_ignored_are_refused(tmp_path, capsys):
    folder = write_checkpoint(tmp_path, ours())
    for flags, says in ((["--checkpoint", "0", "--num-labels", "3"], "--num-labels checks a classifier"),
                        (["--checkpoint", "0", "--glue-weights", "x.model"], "not both")):
        assert main(["export-hf", "--model-dir", str(folder), "--output", str(tmp_path / "hf"), *flags]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_shorter_max_seq_len_on_import_keeps_the_first_positions_and_computes_roberta_on_short_inputs(tmp_path):
    roberta, src = hf_roberta(tmp_path)
    import_hf(src, tmp_path / "ours", overrides={"attn_type": "softmax", "max_seq_len": SEQ // 2}, log=lambda s: None)
    model = load_imported(tmp_path / "ours")
    table = model.encoder.embeddings.position_embeddings.weight
    assert torch.equal(table, roberta.roberta.embeddings.position_embeddings.weight[:SEQ // 2 + 2])
    ids = token_ids(n=SEQ // 2)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), roberta(ids).logits, atol=ATOL, rtol=0)


def test_the_exported_config_carries_the_layer_norm_epsilon_and_the_datas_special_tokens():
    from nystromformer.interop import hf_config_kwargs
    kwargs = hf_config_kwargs(model_config(layer_norm_eps=1e-7, pad_token_id=5), {"bos": 3, "eos": 4, "pad": 5})
    assert (kwargs["layer_norm_eps"], kwargs["bos_token_id"], kwargs["eos_token_id"], kwargs["pad_token_id"]) == \
        (1e-7, 3, 4, 5)


@pytest.mark.parametrize("non_zero_layers, imported_kernel", [([0, 1], 1), ([1], 1), ([], None)],
                         ids=["every layer's", "one layer's", "none (our export of no conv)"])
def test_import_reads_a_1x1_conv_as_no_conv_only_when_all_its_weights_are_zero(tmp_path, non_zero_layers,
                                                                              imported_kernel):
    hf, src = hf_nystromformer(tmp_path, conv_kernel_size=1)  # random weights: every layer's 1x1 conv non-zero
    with torch.no_grad():
        for i, layer in enumerate(hf.nystromformer.encoder.layer):
            if i not in non_zero_layers:
                layer.attention.self.conv.weight.zero_()
    hf.save_pretrained(str(src))
    import_hf(src, tmp_path / "ours", log=lambda s: None)
    model = load_imported(tmp_path / "ours")
    assert model.config.conv_kernel_size == imported_kernel
    if imported_kernel is not None:
        for i, layer in enumerate(hf.nystromformer.encoder.layer):
            assert torch.equal(model.encoder.layers[i].attention.attn.conv.weight, layer.attention.self.conv.weight)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_glue_weights_without_a_model_config_export_with_config_json_and_the_position_tables_length(tmp_path):
    # A fine-tuning run may tile positions beyond the pretraining length: a weights file that does not record its
    # model_config is read with config.json's settings (here conv 5, 8 landmarks) and max_seq_len from its table.
    long = SEQ * 2
    mc = model_config(num_landmarks=8, conv_kernel_size=5, max_seq_len=long)
    model = randomize(NystromformerForSequenceClassification(mc, 3))
    folder = write_model_dir(tmp_path / "m", tiny_config(num_landmarks=8, conv_kernel_size=5))  # max_seq_len 32
    weights = tmp_path / "best.model"
    atomic.torch_save(weights, {"model_state_dict": model.state_dict(), "num_labels": 3, "task": "MNLI"})
    out = export_hf(load_config(folder), tmp_path / "hf", glue_weights=weights, log=lambda s: None)
    hf_cfg = json.loads((out / "config.json").read_text())
    assert (hf_cfg["max_position_embeddings"], hf_cfg["segment_means_seq_len"], hf_cfg["num_landmarks"],
            hf_cfg["conv_kernel_size"]) == (long, long, 8, 5)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    ids = token_ids(n=long)  # transformers' Nystrom path takes exactly segment_means_seq_len tokens
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=ATOL, rtol=0)
    # config.json edited since (no conv): the weights without a model_config are refused, naming the weight, rather
    # than exported as another model; with the model_config fine-tuning records, they export as trained.
    changed = json.loads((folder / "config.json").read_text())
    changed["model"]["conv_kernel_size"] = None
    (folder / "config.json").write_text(json.dumps(changed))
    with pytest.raises(InteropError, match=r"best.model: encoder.layers.0.attention.attn.conv.weight: not in the "
                                           r"model; the model settings \(max_seq_len 64, conv_kernel_size None"):
        export_hf(load_config(folder), tmp_path / "hf2", glue_weights=weights, log=lambda s: None)
    atomic.torch_save(weights, {"model_state_dict": model.state_dict(), "num_labels": 3, "task": "MNLI",
                                "model_config": dataclasses.asdict(mc)})
    out = export_hf(load_config(folder), tmp_path / "hf3", glue_weights=weights, log=lambda s: None)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=ATOL, rtol=0)


def test_a_softmax_model_exports_with_a_zero_1x1_conv_whatever_its_conv_kernel_size_and_imports_back_exact(
        tmp_path):
    model = ours(attn_type="softmax", conv_kernel_size=5)  # softmax attention has no conv: the setting is unused
    assert not any(".conv." in k for k in model.state_dict())
    folder = write_checkpoint(tmp_path, model)
    out = export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=lambda s: None)
    hf_cfg = json.loads((out / "config.json").read_text())
    assert (hf_cfg["conv_kernel_size"], hf_cfg["num_landmarks"], hf_cfg["segment_means_seq_len"]) == (1, SEQ, SEQ)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(out)).eval()
    convs = [v for k, v in hf.state_dict().items() if k.endswith("attention.self.conv.weight")]
    assert len(convs) == 2 and all(c.shape == (4, 1, 1, 1) and not c.any() for c in convs)
    ids = token_ids(n=SEQ - 7)  # the exact path takes any length, as our softmax attention
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.logits(ids), atol=ATOL, rtol=0)
    import_hf(out, tmp_path / "back", log=lambda s: None)  # back as exact attention without conv
    back = load_imported(tmp_path / "back")
    assert back.config.conv_kernel_size is None and back.config.num_landmarks >= back.config.max_seq_len == SEQ
    with torch.no_grad():
        torch.testing.assert_close(back.logits(ids), model.logits(ids), atol=ATOL, rtol=0)


def test_export_into_a_model_folder_of_ours_or_other_files_is_refused_and_touches_nothing(tmp_path, capsys):
    folder = write_checkpoint(tmp_path, ours(num_landmarks=8))
    config_before = (folder / "config.json").read_bytes()
    assert main(["export-hf", "--model-dir", str(folder), "--checkpoint", "0", "--output", str(folder)]) == 2
    assert "not a transformers model folder" in capsys.readouterr().err
    assert (folder / "config.json").read_bytes() == config_before and not (folder / "model.safetensors").exists()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    assert main(["export-hf", "--model-dir", str(folder), "--checkpoint", "0", "--output", str(notes)]) == 2
    assert "give a new or empty one" in capsys.readouterr().err
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]
    assert not list(tmp_path.glob(".*.tmp*"))  # no staging folder left behind


def test_export_over_a_previous_export_needs_overwrite_and_replaces_every_file(tmp_path, capsys):
    folder = write_checkpoint(tmp_path, ours(num_landmarks=8))
    args = ["export-hf", "--model-dir", str(folder), "--checkpoint", "0", "--output", str(tmp_path / "hf")]
    assert main(args) == 0
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"an older export's weights")
    capsys.readouterr()
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "hf" / "pytorch_model.bin").exists()
    assert main(args + ["--overwrite"]) == 0
    assert not (tmp_path / "hf" / "pytorch_model.bin").exists()  # transformers would have preferred neither
    assert transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf")) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m"]  # no staging or old folder left


def test_a_failed_export_leaves_the_previous_one_as_it_was(tmp_path, monkeypatch):
    folder = write_checkpoint(tmp_path, ours(num_landmarks=8))
    out = export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=lambda s: None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", disk_full)
    with pytest.raises(OSError):
        export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=lambda s: None, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m"]


def test_import_with_another_conv_kernel_size_than_the_weights_names_both(tmp_path, capsys):
    folder = write_checkpoint(tmp_path, ours(num_landmarks=8, conv_kernel_size=None))
    export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=lambda s: None)  # "no conv": a zero 1x1 conv
    code = main(["import-hf", "--input", str(tmp_path / "hf"), "--model-dir", str(tmp_path / "back"),
                 "--conv-kernel-size", "5"])
    assert code == 2
    assert "model.conv_kernel_size 5, but the weights' conv kernel is 1" in capsys.readouterr().err
    assert not (tmp_path / "back" / "imported").exists()


def test_an_export_killed_mid_way_is_cleaned_up_or_restored_by_the_next(tmp_path):
    from nystromformer.interop import STAGING_SUFFIX
    folder = write_checkpoint(tmp_path, ours(num_landmarks=8))
    out = export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=lambda s: None)
    files = sorted(p.name for p in out.iterdir())
    # killed between the two renames: the previous export is aside, no "hf"
    aside = tmp_path / f".hf.abc{STAGING_SUFFIX}.old"
    out.rename(aside)
    half = tmp_path / f".hf.def{STAGING_SUFFIX}"  # and a half-written new one
    half.mkdir()
    (half / "config.json").write_text("{")
    # another output's ("hf.v2"), whose names start the same way: not this export's to remove or restore
    others = [f".hf.v2.ghi{STAGING_SUFFIX}", f".hf.v2.jkl{STAGING_SUFFIX}.old"]
    for name in others:
        (tmp_path / name).mkdir()
    logs = []
    with pytest.raises(InteropError, match="--overwrite"):  # the restored export still needs --overwrite
        export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=logs.append)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == files
    assert any("restoring" in line for line in logs) and any("removing" in line for line in logs)
    assert sorted(p.name for p in tmp_path.iterdir()) == others + ["hf", "m"]


def test_a_folder_named_like_a_temporary_file_in_the_checkpoint_folder_is_left_alone(tmp_path):
    (tmp_path / ".cp-0001.model.x1.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / ".hf.x2.tmp").mkdir()
    checkpoint.remove_stale_temp_files(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".hf.x2.tmp"]


def test_a_checkpoint_whose_recorded_settings_no_longer_validate_is_exported_with_a_note(tmp_path):
    model = ours(num_landmarks=8)
    folder = write_checkpoint(tmp_path, model)
    path = folder / "model" / "cp-0000.model"
    saved = checkpoint.load(path)
    saved["config"] = {"model": {**dataclasses.asdict(model.config), "attn_type": "an-old-name"}}
    atomic.torch_save(path, saved)
    logs = []
    export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=logs.append)
    assert any("records model settings this version does not accept" in line and "attn_type" in line
               for line in logs), logs


def test_a_checkpoint_from_before_hidden_act_exports_the_exact_gelu_it_was_trained_with(tmp_path):
    model = ours(num_landmarks=8, hidden_act="gelu")
    folder = write_checkpoint(tmp_path, model)  # config.json: hidden_act "gelu", from the model
    path = folder / "model" / "cp-0000.model"
    saved = checkpoint.load(path)
    saved["config"] = {"model": {k: v for k, v in dataclasses.asdict(model.config).items() if k != "hidden_act"}}
    atomic.torch_save(path, saved)
    out = export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=lambda s: None)
    assert json.loads((out / "config.json").read_text())["hidden_act"] == "gelu"


def test_import_reads_an_existing_config_json_as_strictly_as_every_command(tmp_path, capsys):
    folder = write_checkpoint(tmp_path, ours(num_landmarks=8))
    export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=lambda s: None)
    target = tmp_path / "continued"
    target.mkdir()
    (target / "config.json").write_text('{"model": {"num_layers": 2, "num_layers": 3}}')
    assert main(["import-hf", "--input", str(tmp_path / "hf"), "--model-dir", str(target)]) == 2
    assert "model.num_layers: appears more than once" in capsys.readouterr().err


def test_a_previous_export_left_aside_beside_a_completed_one_is_removed_not_restored_over_it(tmp_path):
    # killed after the new export was renamed in, before the old one (aside) was removed: the next export removes
    # the leftover and replaces the output; renaming the leftover onto the existing output would fail or lose it
    from nystromformer.interop import STAGING_SUFFIX
    folder = write_checkpoint(tmp_path, ours(num_landmarks=8))
    out = export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=lambda s: None)
    files = sorted(p.name for p in out.iterdir())
    aside = tmp_path / f".hf.abc{STAGING_SUFFIX}.old"
    aside.mkdir()
    (aside / "config.json").write_text('{"model_type": "nystromformer"}')
    logs = []
    export_hf(load_config(folder), tmp_path / "hf", epoch=0, log=logs.append, overwrite=True)
    assert not aside.exists() and any("removing" in line for line in logs)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m"]


def test_a_nystromformer_checkpoint_without_a_layer_s_conv_is_refused_not_left_at_our_init(tmp_path):
    # Only RoBERTa (no conv at all) may leave the attention's parameters at our initialisation.
    _, src = hf_nystromformer(tmp_path)
    broken = resave(src, tmp_path / "bad", lambda k: None if "layer.1.attention.self.conv" in k else k)
    with pytest.raises(InteropError, match=r"1 encoder weight\(s\) are not in the transformers weights, e.g. "
                                           r"nystromformer.encoder.layer.1.attention.self.conv.weight"):
        import_hf(broken, tmp_path / "ours", log=lambda s: None)


def test_an_untied_decoder_bias_is_refused_rather_than_silently_replaced_by_the_head_s_bias(tmp_path):
    from safetensors.torch import load_file
    _, src = hf_nystromformer(tmp_path)
    state = load_file(str(src / "model.safetensors"))
    state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"] + 1
    state["cls.predictions.decoder.weight"] = state["nystromformer.embeddings.word_embeddings.weight"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    torch.save(state, bad / "pytorch_model.bin")
    with pytest.raises(InteropError, match=r"cls.predictions.decoder.bias differs from cls.predictions.bias"):
        import_hf(bad, tmp_path / "ours", log=lambda s: None)
    assert not (tmp_path / "ours" / "imported").exists()


def test_trained_conv_weights_that_another_attention_type_discards_are_reported_as_not_used(tmp_path):
    # a zero 1x1 conv (our export of "no conv") is dropped silently; trained conv weights never are
    _, src = hf_nystromformer(tmp_path)
    logs = []
    import_hf(src, tmp_path / "ours", overrides={"attn_type": "softmax"}, log=logs.append)
    [unused] = [line for line in logs if line.startswith("transformers weights not used")]
    assert "nystromformer.encoder.layer.0.attention.self.conv.weight" in unused


def test_glue_weights_fine_tuned_on_shorter_inputs_export_with_that_input_length(tmp_path):
    """A GLUE run with --max-seq-len 16 on a 32-token model was trained and predicted on inputs padded to 16 (its
    Nyström landmarks: means over 16 tokens). transformers' Nyström path takes exactly segment_means_seq_len tokens:
    the export must use the run's 16, not the position table's 32, or the classifier cannot be run on the inputs it
    was fine-tuned on (transformers folds the batch rows into the segments and gives other logits)."""
    mc = model_config(num_landmarks=8)
    model = randomize(NystromformerForSequenceClassification(mc, 2))
    folder = write_model_dir(tmp_path / "m", tiny_config(num_landmarks=8))
    weights = tmp_path / "best.model"
    atomic.torch_save(weights, {"model_state_dict": model.state_dict(), "num_labels": 2, "task": "RTE",
                                "model_config": dataclasses.asdict(mc), "settings": {"task": "RTE", "max_seq_len": 16}})
    out = export_hf(load_config(folder), tmp_path / "hf", glue_weights=weights, log=lambda s: None)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert hf.config.segment_means_seq_len == 16 and hf.config.max_position_embeddings == SEQ
    ids = token_ids(n=16)  # the run's input length, no padding
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=ATOL, rtol=0)
    # Landmarks >= the run's length: exact softmax there, as ours computes on 16 tokens with 16 landmarks.
    mc16 = model_config(num_landmarks=16)
    model16 = randomize(NystromformerForSequenceClassification(mc16, 2))
    atomic.torch_save(weights, {"model_state_dict": model16.state_dict(), "num_labels": 2, "task": "RTE",
                                "model_config": dataclasses.asdict(mc16),
                                "settings": {"task": "RTE", "max_seq_len": 16}})
    out = export_hf(load_config(folder), tmp_path / "hf16", glue_weights=weights, log=lambda s: None)
    hf16 = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert hf16.config.num_landmarks == hf16.config.segment_means_seq_len == 16
    with torch.no_grad():
        torch.testing.assert_close(hf16(ids).logits, model16(ids), atol=ATOL, rtol=0)
