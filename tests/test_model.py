"""The encoder and its heads."""
import pytest
import torch
import torch.nn.functional as F

from nystromformer.config import ATTENTION_TYPES, config_from_dict
from nystromformer.mlm import padding_mask
from nystromformer.model import (IGNORE_INDEX, NystromformerForMaskedLM, NystromformerForSequenceClassification,
                                 fixed_weights, masked_positions_of)

from helpers import WeightCasts, tiny_config


def model_config(**kw):
    return config_from_dict(tiny_config(dropout_prob=0.0, **kw)).model


def test_masked_lm_loss_equals_cross_entropy_over_full_logits_at_masked_positions():
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(model_config()).eval()
    ids = torch.randint(5, 64, (3, 32))
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, ::5] = ids[:, ::5]
    out = model(ids, labels)
    full = F.cross_entropy(model.logits(ids).transpose(1, 2), labels, ignore_index=IGNORE_INDEX)
    assert torch.allclose(out.loss, full, atol=1e-5)
    assert out.num_masked.item() == (labels != IGNORE_INDEX).sum().item()
    # The dev accuracy counts the masked positions whose most likely token is the label; make some right.
    predicted = model.logits(ids).argmax(-1)
    labels[0, ::5] = predicted[0, ::5]
    chosen = labels != IGNORE_INDEX
    correct = (predicted[chosen] == labels[chosen]).sum().item()
    assert 7 <= correct < chosen.sum().item() and model(ids, labels).num_correct.item() == correct


def test_masked_positions_found_by_the_caller_give_the_same_loss_and_gradients_as_the_labels_mask():
    # Pretraining finds them on the host before the batch is copied (no device sync for a data-dependent size).
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(model_config())
    ids = torch.randint(5, 64, (3, 32))
    labels = torch.where(torch.rand(3, 32) < 0.2, ids, IGNORE_INDEX)
    results = []
    for positions in (None, masked_positions_of(labels)):
        model.zero_grad()
        out = model(ids, labels, masked_positions=positions)
        out.loss.backward()
        embedding_grad = model.encoder.embeddings.word_embeddings.weight.grad
        results.append((out.loss_sum, out.num_masked, out.num_correct, embedding_grad))
    for given, found in zip(*results):
        assert torch.equal(given, found)
    labelled = [i for i, label in enumerate(labels.view(-1)) if label != IGNORE_INDEX]
    assert masked_positions_of(labels).tolist() == labelled


def test_mlm_decoder_is_tied_to_the_word_embeddings():
    model = NystromformerForMaskedLM(model_config()).eval()
    assert not any("decoder" in n for n, _ in model.named_parameters())
    ids = torch.randint(8, 64, (2, 32))  # token 7 is not in the input, so only the decoder sees its row
    before = model.logits(ids)
    with torch.no_grad():
        model.encoder.embeddings.word_embeddings.weight[7] += 1.0
    after = model.logits(ids)
    assert not torch.allclose(before[..., 7], after[..., 7])
    assert torch.equal(before[..., 8:], after[..., 8:])


def test_softmax_model_outputs_for_real_tokens_ignore_padding():
    torch.manual_seed(1)
    model = NystromformerForSequenceClassification(model_config(attn_type="softmax"), num_labels=3).eval()
    ids = torch.randint(5, 64, (1, 20))
    padded = torch.cat([ids, torch.ones(1, 12, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 20), torch.zeros(1, 12)], dim=1).long()
    assert torch.allclose(model(ids), model(padded, attention_mask=mask), atol=1e-5)


@pytest.mark.parametrize("attn_type", sorted(ATTENTION_TYPES))
def test_no_attention_mask_means_no_padding_for_every_attention(attn_type):
    # Pretraining passes attention_mask=None for full-length rows; it must be the all-ones mask exactly.
    extra = dict(num_global_tokens=1, block_size=4, window_size=4, linformer_k=8, reformer_bucket_size=4,
                 bigbird_num_random_blocks=1, bigbird_num_global_blocks=1, performer_num_features=16)
    torch.manual_seed(4)
    model = NystromformerForMaskedLM(model_config(attn_type=attn_type, **extra)).double().eval()
    ids = torch.randint(5, 64, (2, 32))
    outs = []
    for mask in (None, torch.ones(2, 32, dtype=torch.long)):
        torch.manual_seed(5)  # reformer's hashing and performer's features draw at forward time
        outs.append(model.logits(ids, attention_mask=mask))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)


def test_pretraining_passes_no_mask_for_rows_without_padding():
    assert padding_mask(torch.tensor([[5, 6, 7], [8, 9, 10]]), pad_id=1) is None
    mask = padding_mask(torch.tensor([[5, 6, 7], [8, 1, 1]]), pad_id=1)
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]] and mask.dtype == torch.long


@pytest.mark.parametrize("attn_type", ["softmax", "nystrom"])
def test_gradient_checkpointing_changes_memory_not_results(attn_type):
    torch.manual_seed(2)
    ids = torch.randint(5, 64, (2, 32))
    labels = ids.clone()
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(3)
        model = NystromformerForMaskedLM(model_config(attn_type=attn_type, attention_grad_checkpointing=ckpt,
                                                      gelu_grad_checkpointing=ckpt))
        model(ids, labels).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_performer_features_are_redrawn_once_per_training_pass_under_gradient_checkpointing(interval):
    # The checkpoint's backward reruns the attention's forward: redrawing there would give the backward other
    # features than the forward used (and count each pass twice).
    torch.manual_seed(2)
    ids = torch.randint(5, 64, (2, 32))
    runs = []
    for ckpt in (False, True):
        torch.manual_seed(3)
        model = NystromformerForMaskedLM(model_config(attn_type="performer", performer_redraw_interval=interval,
                                                      attention_grad_checkpointing=ckpt)).double()
        attn = model.encoder.layers[0].attention.attn
        grads, counts = [], []
        for _ in range(5):
            model.zero_grad()
            model(ids, ids.clone()).loss.backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            counts.append(int(attn.forwards_since_redraw))
        runs.append((grads, counts, attn.projection.clone()))
    (plain_grads, plain_counts, plain_w), (ckpt_grads, ckpt_counts, ckpt_w) = runs
    assert plain_counts == ckpt_counts == [(i % interval) + 1 for i in range(5)]
    assert torch.equal(plain_w, ckpt_w)
    for plain, ckpt in zip(plain_grads, ckpt_grads):
        torch.testing.assert_close(ckpt, plain, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("attn_type", ["nystrom", "performer", "bigbird", "reformer"])
def test_a_compiled_encoder_runs_as_one_graph_per_training_step_and_evaluation(attn_type):
    # Performer's redraw count, BigBird's block layout and Reformer's evaluation rotation are host work (a device
    # read, a generator): inside the compiled forward each split the graph at every layer, every step. They run
    # in the encoder's eager prelude; the layers stay one graph. (Performer redraws every pass here, still.)
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(model_config(attn_type=attn_type, num_layers=2, performer_redraw_interval=1,
                                                  block_size=8, reformer_bucket_size=8))
    projections = []

    def after_each_pass():
        if attn_type == "performer":
            projections.append(model.encoder.layers[0].attention.attn.projection.clone())
    assert graphs_per_pass(model, ("train", "train", "train", "eval", "eval"), after_each_pass) == [1, 1, 1, 1, 1]
    if attn_type == "performer":
        assert not torch.equal(projections[0], projections[1]) and torch.equal(projections[3], projections[4])


def graphs_per_pass(model, modes, after_each_pass=lambda: None):
    """The encoder compiled with a backend that counts the graphs run: how many, for each pass of ``modes``
    ("train": forward and backward of the MLM loss; "eval": logits). From a clean Dynamo cache: its recompile
    limit counts the earlier compiles of the encoder's forward in this process, whatever model they were of."""
    torch._dynamo.reset()
    pieces = []

    def counting_backend(graph, example_inputs):
        def run(*args):
            pieces.append(1)
            return graph.forward(*args)
        return run
    model.encoder.compile(backend=counting_backend)
    ids = torch.randint(5, 64, (2, 32))
    per_call = []
    for mode in modes:
        model.train(mode == "train")
        pieces.clear()
        model(ids, ids.clone()).loss.backward() if mode == "train" else model.logits(ids)
        per_call.append(len(pieces))
        after_each_pass()
    return per_call


def test_attention_runs_in_fp32_under_autocast_when_configured():
    seen = []
    for fp32 in (True, False):
        model = NystromformerForMaskedLM(model_config(attention_fp32=fp32))
        attn = model.encoder.layers[0].attention.attn
        handle = attn.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.logits(torch.randint(5, 64, (1, 32)))
        handle.remove()
    assert seen[0] == (torch.float32, torch.float32)
    assert seen[1][0] == torch.bfloat16


@pytest.mark.parametrize("attn_type", ["softmax", "nystrom", "performer", "reformer"])
def test_query_key_and_value_are_one_product_equal_to_three_separate_projections(attn_type):
    # The three projections run as one matrix product with their weights joined; the parameters (and so
    # checkpoints, interop and the optimizer's state) stay the three nn.Linear modules.
    torch.manual_seed(0)
    block = NystromformerForMaskedLM(model_config(attn_type=attn_type)).double().encoder.layers[0].attention
    assert [name for name, _ in block.named_parameters()][:6] == [
        "query.weight", "query.bias", "key.weight", "key.bias", "value.weight", "value.bias"]
    x = torch.randn(2, 32, block.query.in_features, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 32)
    mask[1, 20:] = 0
    b, n, _ = x.shape
    split = lambda t: t.view(b, n, block.num_head, block.head_dim).transpose(1, 2)  # noqa: E731
    torch.manual_seed(1)  # Reformer draws its hash rotations from torch's RNG: the same for both
    separately = block.attn(split(block.query(x)), split(block.key(x)), split(block.value(x)), mask)
    separately = block.output(separately.transpose(1, 2).reshape(b, n, -1))
    torch.manual_seed(1)
    joined = block(x, mask)
    assert (joined - separately).abs().max() < 1e-12
    params = [x] + list(block.parameters())
    g = torch.randn_like(joined)
    grads = zip(torch.autograd.grad(joined, params, g, allow_unused=True),
                torch.autograd.grad(separately, params, g, allow_unused=True))
    for (name, _), (a, e) in zip([("x", x)] + list(block.named_parameters()), grads):
        if attn_type == "reformer" and name.startswith("key."):
            # shared QK: the key projection is not computed, so it gets no gradient (and no weight decay)
            assert a is None and e is None, name
        else:
            assert (a - e).abs().max() < 1e-12, name


def test_under_autocast_the_block_keeps_one_half_precision_copy_of_its_input_for_the_projections():
    # Three separate projections would each cast the (fp32, from LayerNorm) input to bf16 and keep its cast for
    # the backward: two needless sequence-sized copies per layer.
    model = NystromformerForMaskedLM(model_config())
    block = model.encoder.layers[0].attention
    # not a leaf, as in the model (autocast reuses its casts of leaves that require grad)
    x = torch.randn(2, 32, block.query.in_features, requires_grad=True) * 1
    saved = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and t.numel() == x.numel():  # as (b·n, dim): a product's input
            saved[t.untyped_storage().data_ptr()] = t
        return t
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, None)
    # the projections' input and the output projection's input (the attention's output)
    assert len(saved) == 2, [t.shape for t in saved.values()]


def accumulated(model, ids, labels, *, fixed, dtype=torch.bfloat16):
    """Losses and summed parameter gradients of one micro-batch per row: in one autocast region with fixed
    weights (as a pretraining step runs them), or in one autocast region per micro-batch."""
    model.zero_grad(set_to_none=True)
    autocast = lambda: torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)  # noqa: E731
    losses = []

    def micro_batch(i):
        loss = model(ids[i:i + 1], labels[i:i + 1]).loss
        with torch.autocast("cpu", enabled=False):
            loss.backward()
        losses.append(loss.detach())
    if fixed:
        with autocast(), fixed_weights(model):
            for i in range(len(ids)):
                micro_batch(i)
    else:
        for i in range(len(ids)):
            with autocast():
                micro_batch(i)
    return torch.stack(losses), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bf16-autocast", "fp32"])
@pytest.mark.parametrize("attn_type", ["softmax", "nystrom", "reformer"])
def test_micro_batches_with_fixed_weights_give_bitwise_the_losses_and_gradients_of_separate_passes(attn_type,
                                                                                                   dtype):
    # Inside fixed_weights (and one autocast region) each weight is joined and cast once for all the micro-batches,
    # not once per micro-batch; the arithmetic is the same, so the results are the same to the bit.
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(model_config(attn_type=attn_type))
    ids = torch.randint(5, 64, (3, 32))
    labels = torch.where(torch.rand(3, 32) < 0.3, ids, IGNORE_INDEX)
    torch.manual_seed(1)  # Reformer's hash rotations
    separate = accumulated(model, ids, labels, fixed=False, dtype=dtype)
    torch.manual_seed(1)
    fixed = accumulated(model, ids, labels, fixed=True, dtype=dtype)
    assert torch.equal(fixed[0], separate[0])
    assert fixed[1].keys() == separate[1].keys()
    assert ("encoder.layers.0.attention.key.weight" in fixed[1]) == (attn_type != "reformer")
    for name in separate[1]:
        assert torch.equal(fixed[1][name], separate[1][name]), name


def test_under_autocast_fixed_weights_casts_each_weight_once_for_all_the_micro_batches():
    model = NystromformerForMaskedLM(model_config())
    ids = torch.randint(5, 64, (4, 32))
    labels = torch.where(torch.rand(4, 32) < 0.3, ids, IGNORE_INDEX)
    counts = {}
    for fixed in (False, True):
        with WeightCasts() as casts:
            accumulated(model, ids, labels, fixed=fixed)
        params = casts.of_parameters(model)
        counts[fixed] = sum(params.values()), max(params.values()), casts.of_joined_qkv(model)
    layers = model.config.num_layers
    # per layer the output projection's and the feed-forward's weights and biases; the MLM head's dense weight
    # and bias, the tied decoder's weight and its bias; and per layer the joined q, k, v weight
    assert counts[False] == (4 * (6 * layers + 4), 4, 4 * layers)
    assert counts[True] == (6 * layers + 4, 1, layers)


def test_fixed_weights_blocks_nest_and_share_the_outer_block_s_copies():
    model = NystromformerForMaskedLM(model_config())
    ids = torch.randint(5, 64, (1, 32))
    with WeightCasts() as casts, torch.autocast("cpu", dtype=torch.bfloat16), fixed_weights(model):
        model.logits(ids)
        with fixed_weights(model):
            model.logits(ids)
        model.logits(ids)
    assert casts.of_joined_qkv(model) == model.config.num_layers
    assert all(layer.attention._fixed is None for layer in model.encoder.layers)


def test_a_weight_changed_in_place_inside_fixed_weights_is_an_error_not_a_stale_copy():
    model = NystromformerForMaskedLM(model_config())
    ids = torch.randint(5, 64, (1, 32))
    with fixed_weights(model):
        model.logits(ids)
        with torch.no_grad():
            model.encoder.layers[1].attention.value.weight.mul_(2)  # as an optimizer step would
        with pytest.raises(RuntimeError, match="changed in place inside fixed_weights"):
            model.logits(ids)
    before = model.logits(ids)  # outside the block the weights are joined afresh
    with torch.no_grad():
        model.encoder.layers[1].attention.value.weight.mul_(2)
    assert not torch.equal(model.logits(ids), before)


def test_inside_fixed_weights_an_evaluation_without_grad_does_not_leave_the_training_passes_without_gradients():
    model = NystromformerForMaskedLM(model_config())
    ids = torch.randint(5, 64, (1, 32))
    with fixed_weights(model):
        with torch.no_grad():
            model.logits(ids)
        model.logits(ids).sum().backward()
    assert model.encoder.layers[0].attention.query.weight.grad is not None


def test_regression_head_has_one_output_and_mse_loss():
    model = NystromformerForSequenceClassification(model_config(), num_labels=1)
    ids = torch.randint(5, 64, (4, 16))
    scores = model(ids)
    assert scores.shape == (4,)
    target = torch.tensor([0.0, 1.5, 3.0, 5.0])
    assert torch.allclose(model.loss(scores, target), F.mse_loss(scores, target))


def test_token_types_and_lengths_up_to_max_seq_len():
    model = NystromformerForMaskedLM(model_config(num_sen_type=2))
    ids = torch.randint(5, 64, (2, 32))
    types = torch.zeros_like(ids)
    types[:, 16:] = 1
    assert not torch.allclose(model.logits(ids, token_type_ids=types), model.logits(ids))
    with pytest.raises(ValueError, match="exceeds model.max_seq_len 32"):
        model.logits(torch.randint(5, 64, (1, 33)))


def test_pre_layer_norm_blocks_normalise_before_each_sublayer_and_at_the_end():
    torch.manual_seed(4)
    model = NystromformerForSequenceClassification(model_config(pre_layer_norm=True, num_layers=1), num_labels=2).eval()
    with torch.no_grad():  # LayerNorms away from their identity init, so that norm1 and norm2 differ
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    enc, block = model.encoder, model.encoder.layers[0]
    ids = torch.randint(5, 64, (2, 16))
    mask = torch.ones_like(ids)
    x = enc.embeddings(ids, None)
    x = x + block.attention(block.norm1(x), mask)
    x = x + block.ffn(block.norm2(x))
    assert torch.allclose(enc(ids), enc.final_norm(x), atol=1e-6)
    post = NystromformerForSequenceClassification(model_config(num_layers=1), num_labels=2)
    assert post.encoder.final_norm is None


def test_an_embedding_narrower_than_the_transformer_is_projected_up_and_trained():
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(model_config(embedding_dim=16))
    ids = torch.randint(5, 64, (2, 32))
    labels = torch.where(torch.rand(2, 32) < 0.3, ids, torch.full_like(ids, IGNORE_INDEX))
    model(ids, labels).loss.backward()
    projection = model.encoder.embedding_projection
    assert projection.weight.shape == (32, 16) and projection.weight.grad.abs().sum() > 0
    # The tied decoder works in the embedding width: the MLM head projects back down.
    assert model.encoder.embeddings.word_embeddings.weight.shape == (64, 16)
    assert model.mlm_head.dense.weight.shape == (16, 32)


@pytest.mark.parametrize("scheme", ["paper", "bert"])
def test_weights_start_as_the_authors_code_or_as_bert_does(scheme):
    # "paper": N(0, 0.02) embeddings, PyTorch's default uniform init for linear layers and the MLM bias (the
    # authors' code); "bert": N(0, 0.02) matrices and zero biases. Unit LayerNorms in both.
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(config_from_dict(tiny_config(transformer_dim=64, num_head=8, embedding_dim=64,
                                                                  vocab_size=4000, weight_init=scheme)).model)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            bound = module.in_features ** -0.5
            if scheme == "paper":  # uniform in +-1/sqrt(fan_in): std bound/sqrt(3)
                assert abs(module.weight.std().item() / (bound / 3 ** 0.5) - 1) < 0.1, name
                assert module.weight.abs().max() <= bound and module.bias.abs().max() <= bound, name
                assert module.bias.any(), name
            else:
                assert abs(module.weight.std().item() / 0.02 - 1) < 0.1 and not module.bias.any(), name
        if isinstance(module, torch.nn.LayerNorm):
            assert (module.weight == 1).all() and not module.bias.any(), name
    word = model.encoder.embeddings.word_embeddings.weight
    assert abs(word.std().item() - 0.02) < 0.001 and abs(word.mean().item()) < 0.001
    bias = model.mlm_head.bias  # the authors' decoder was an nn.Linear(embedding_dim, vocab) with its bias
    if scheme == "paper":
        assert bias.abs().max() <= 64 ** -0.5 and abs(bias.std().item() / (64 ** -0.5 / 3 ** 0.5) - 1) < 0.1
    else:
        assert not bias.any()


@pytest.mark.parametrize("hidden_act, approximate", [("gelu_tanh", "tanh"), ("gelu", "none")])
def test_the_feed_forward_and_heads_use_the_configured_gelu(hidden_act, approximate):
    # The authors' Approx_GeLU is the tanh form (transformers' "gelu_new"); "gelu" is the exact erf form.
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(config_from_dict(tiny_config(hidden_act=hidden_act)).model)
    ffn = model.encoder.layers[0].ffn
    x = torch.randn(2, 5, ffn.dense_in.in_features, dtype=torch.float64)
    ffn.double()
    expected = ffn.dense_out(torch.nn.functional.gelu(ffn.dense_in(x), approximate=approximate))
    torch.testing.assert_close(ffn(x), expected, rtol=0, atol=0)
    other = torch.nn.functional.gelu(ffn.dense_in(x), approximate="none" if approximate == "tanh" else "tanh")
    assert not torch.allclose(ffn(x), ffn.dense_out(other), rtol=0, atol=1e-9)
    assert model.mlm_head.act(x).equal(torch.nn.functional.gelu(x, approximate=approximate))


def test_a_compiled_encoder_inside_fixed_weights_runs_as_one_graph_per_pass():
    # fixed_weights' joined-weight cache is host work (a dict, version counters): compiled, the projections take
    # the plain join, or every layer would split the graph
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(model_config(num_layers=2))
    with fixed_weights(model):
        assert graphs_per_pass(model, ("train", "train", "eval")) == [1, 1, 1]


def test_batch_groups_of_fewer_than_one_row_are_refused_when_set():
    from nystromformer.model import set_batch_groups
    model = NystromformerForMaskedLM(model_config())
    for rows in (0, -1):
        with pytest.raises(ValueError, match="batch groups: rows must be >= 1"):
            set_batch_groups(model, rows)
    set_batch_groups(model, 2)
    groups = [m.init_rows for m in model.modules() if hasattr(m, "init_rows")]
    assert groups and all(rows == 2 for rows in groups)


def test_the_paper_scheme_s_mlm_bias_bound_is_the_decoder_s_fan_in_the_embedding_width():
    # the authors' decoder: nn.Linear(embedding_dim, vocab); with a narrower embedding than the transformer its
    # fan-in is embedding_dim, not transformer_dim
    torch.manual_seed(0)
    model = NystromformerForMaskedLM(config_from_dict(tiny_config(transformer_dim=64, num_head=8, embedding_dim=32,
                                                                  vocab_size=4000, weight_init="paper")).model)
    bias, bound = model.mlm_head.bias, 32 ** -0.5
    assert bias.abs().max() <= bound and abs(bias.std().item() / (bound / 3 ** 0.5) - 1) < 0.1


def test_a_target_of_token_id_0_is_a_masked_position_like_any_other():
    labels = torch.full((2, 5), IGNORE_INDEX)
    labels[0, 1], labels[1, 3] = 0, 7
    assert masked_positions_of(labels).tolist() == [1, 8]
