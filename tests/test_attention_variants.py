"""The efficient-attention baselines: shape, padding, gradients, and each one against its definition."""
import math

import pytest
import torch

from nystromformer.attention import ATTENTION_REGISTRY, build_attention
from nystromformer.config import ATTENTION_TYPES, ConfigError, ModelConfig, config_from_dict
from nystromformer.model import Encoder

from helpers import tiny_config

VARIANTS = ["linformer", "performer", "linear", "reformer", "longformer", "bigbird", "linformer_revisited"]
# Variants whose real outputs ignore the contents of padded positions (all of them; see docs/attention.md).
B, H, N, D = 2, 2, 24, 8


def cfg(attn_type, **kw):
    base = dict(attn_type=attn_type, max_seq_len=32, num_head=H, head_dim=D, transformer_dim=H * D,
                embedding_dim=H * D, transformer_hidden_dim=32, vocab_size=40, linformer_k=8,
                performer_num_features=16, reformer_bucket_size=4, window_size=6, num_global_tokens=1,
                block_size=4, bigbird_num_random_blocks=1, bigbird_num_global_blocks=1)
    base.update(kw)
    c = ModelConfig(**base)
    c.validate()
    return c


def qkv(n=N, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=dtype) for _ in range(3)]


def padded_mask(n=N, real=(N, 17)):
    m = torch.zeros(B, n, dtype=torch.long)
    for i, r in enumerate(real):
        m[i, :r] = 1
    return m


def dense_softmax(q, k, v, allowed):
    """softmax(QKᵀ/√d) V with `allowed` (b or 1, 1, n, n) bool."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def test_all_variants_registered_and_configurable():
    from nystromformer.lra.train import LRA_ATTENTION
    # one list of names in three places: the config's check, the registry, the LRA comparison's settings
    assert set(ATTENTION_TYPES) == set(ATTENTION_REGISTRY) == set(LRA_ATTENTION) == {*VARIANTS, "softmax", "nystrom"}
    c = config_from_dict(tiny_config(attn_type="bigbird", block_size=8))
    assert c.model.attn_type == "bigbird"
    with pytest.raises(ConfigError, match="linformer_sharing"):
        config_from_dict(tiny_config(attn_type="linformer", linformer_k=8, linformer_sharing="layerwise"))
    with pytest.raises(ConfigError, match="linformer_k"):
        config_from_dict(tiny_config(attn_type="linformer", linformer_k=64))  # > max_seq_len 32
    with pytest.raises(ConfigError, match="window_size"):
        config_from_dict(tiny_config(attn_type="longformer", window_size=0))


@pytest.mark.parametrize("name", VARIANTS)
def test_shape_grad_and_padding_contents(name):
    torch.manual_seed(0)
    attn = build_attention(cfg(name)).double()
    attn.eval()
    q, k, v = qkv()
    mask = padded_mask()
    for t in (q, k, v):
        t.requires_grad_(True)
    torch.manual_seed(1)
    out = attn(q, k, v, mask)
    assert out.shape == v.shape and torch.isfinite(out).all()
    out.transpose(1, 2)[mask.bool()].sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0 and v.grad.abs().sum() > 0
    if name != "reformer":  # reformer is shared-QK: k is ignored
        assert k.grad.abs().sum() > 0
    # Changing what sits at padded positions never changes real tokens' outputs.
    q2, k2, v2 = (t.detach().clone() for t in (q, k, v))
    pad = ~mask.bool()
    for t in (q2, k2, v2):
        t.transpose(1, 2)[pad] = 1e3 * torch.randn(int(pad.sum()), H, D, dtype=t.dtype)
    torch.manual_seed(1)
    out2 = attn(q2, k2, v2, mask)
    real = mask.bool()
    torch.testing.assert_close(out2.detach().transpose(1, 2)[real], out.detach().transpose(1, 2)[real])
    # And with the fp32 model in train mode the layer runs end to end.
    model = Encoder(cfg(name))
    hidden = model(torch.randint(0, 40, (2, 20)), torch.ones(2, 20, dtype=torch.long))
    hidden.sum().backward()


def test_linear_matches_explicit_kernel_formula():
    attn = build_attention(cfg("linear"))
    q, k, v = qkv()
    mask = padded_mask()
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    w = phi(q) @ phi(k).transpose(-1, -2) * mask[:, None, None, :]      # (b, h, n, n) kernel, pads dropped
    expected = (w @ v) / w.sum(-1, keepdim=True)
    torch.testing.assert_close(attn(q, k, v, mask), expected, rtol=1e-6, atol=1e-8)


def test_performer_features_positive_and_approximate_softmax():
    from nystromformer.attention.performer import positive_features
    torch.manual_seed(0)
    attn = build_attention(cfg("performer", performer_num_features=8192)).double()
    q, k, v = (0.5 * t for t in qkv())
    phi = positive_features(q * D ** -0.25, attn.projection.double(), is_query=True)
    assert (phi > 0).all()
    mask = padded_mask()
    out = attn(q, k, v, mask)
    exact = dense_softmax(q, k, v, mask.bool()[:, None, None, :])
    err = (out - exact).abs().max().item()
    assert err < 0.05, err
    # Few features: a much worse approximation (the estimator is what converges, not a coincidence).
    few = build_attention(cfg("performer", performer_num_features=2)).double()
    assert (few(q, k, v, mask) - exact).abs().max().item() > err


def test_performer_redraw_depends_on_the_saved_features_alone():
    # DDP ranks seed the global RNG per rank: each must still draw the same new features, and a resumed run
    # (features restored from its checkpoint) the ones an uninterrupted run would.
    a = build_attention(cfg("performer", performer_redraw_interval=3))
    b = build_attention(cfg("performer", performer_redraw_interval=3))
    b.load_state_dict(a.state_dict())
    initial = a.projection.clone()
    for attn, rank in ((a, 0), (b, 1)):
        torch.manual_seed(1000 + rank)
        for _ in range(5):
            attn.prepare(N, "cpu")
    assert not torch.equal(a.projection, initial)  # redrawn
    assert torch.equal(a.projection, b.projection)
    # resumed mid-interval: the count comes back with the state dict (it is kept on the host as well)
    resumed = build_attention(cfg("performer", performer_redraw_interval=3))
    resumed.load_state_dict(a.state_dict())
    for attn in (a, resumed):
        attn.prepare(N, "cpu")  # the 3rd pass since the redraw: no redraw yet
    assert torch.equal(resumed.projection, a.projection) and torch.equal(resumed.projection, b.projection)
    for attn in (a, resumed):
        attn.prepare(N, "cpu")  # the interval is up
    assert torch.equal(resumed.projection, a.projection) and not torch.equal(a.projection, b.projection)


@pytest.mark.parametrize("name", sorted(ATTENTION_REGISTRY))
def test_every_variant_builds_on_the_meta_device(name):
    # export-hf checks a checkpoint's shapes against a model built on the meta device, before anything else
    with torch.device("meta"):
        Encoder(cfg(name))


def differently_seeded_pair(name):
    """Two modules of one variant built from other seeds (another Performer projection, BigBird pattern)."""
    torch.manual_seed(0)
    a = build_attention(cfg(name, performer_redraw_interval=3))
    torch.manual_seed(1)
    return a, build_attention(cfg(name, performer_redraw_interval=3))


def assert_the_next_passes_agree(a, b):
    q, k, v = qkv(dtype=torch.float32)
    mask = padded_mask()
    for _ in range(2):  # the 3rd pass since the redraw, then the interval is up
        for attn in (a, b):
            attn.prepare(N, "cpu")
        torch.testing.assert_close(b(q, k, v, mask), a(q, k, v, mask), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["performer", "bigbird"])
def test_host_copies_of_buffers_follow_writes_from_outside(name):
    # A DDP broadcast writes the buffers in place, not through load_state_dict: Performer's pass count and
    # BigBird's pattern seed, kept on the host so that a pass reads nothing from the device, must follow it.
    a, b = differently_seeded_pair(name)
    q, k, v = qkv(dtype=torch.float32)
    for attn in (a, b):
        attn.prepare(N, "cpu")
        attn(q, k, v, padded_mask())  # host copies and caches made
    a.prepare(N, "cpu")  # a has counted 2 passes, b 1
    with torch.no_grad():
        for target, source in zip(b.buffers(), a.buffers()):
            target.copy_(source)  # as DDP's broadcast from rank 0 does
    assert_the_next_passes_agree(a, b)
    assert [t.tolist() for t in b.buffers()] == [t.tolist() for t in a.buffers()]


@pytest.mark.parametrize("name", ["performer", "bigbird"])
def test_host_copies_of_buffers_follow_a_load_then_a_move_to_another_device(name):
    # GLUE loads the pretrained weights on the CPU, then moves the model to the GPU: the moved buffers are new
    # tensors whose version counters start again at 0, as if never written. (_apply(clone) is what .to(device)
    # does to each tensor.) BigBird was fine-tuned with its initial pattern, Performer counted from 0.
    a, b = differently_seeded_pair(name)
    for _ in range(2):
        a.prepare(N, "cpu")
    b.load_state_dict(a.state_dict())
    b._apply(lambda t: t.clone())
    assert_the_next_passes_agree(a, b)


def test_bigbird_called_directly_after_a_load_uses_the_loaded_pattern():
    # Without the encoder's prepare(): an eager forward reads the seed itself (a state dict loaded since).
    torch.manual_seed(0)
    a = build_attention(cfg("bigbird"))
    torch.manual_seed(1)
    b = build_attention(cfg("bigbird"))
    q, k, v = qkv(dtype=torch.float32)
    mask = padded_mask()
    b(q, k, v, mask)  # its own seed read and its layout cached
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b(q, k, v, mask), a(q, k, v, mask), rtol=0, atol=0)


def test_performer_redraws_every_n_training_forwards():
    torch.manual_seed(0)
    attn = build_attention(cfg("performer", performer_redraw_interval=2))
    q, k, v = qkv(dtype=torch.float32)
    mask = padded_mask()
    seen = [attn.projection.clone()]
    for _ in range(5):
        attn.prepare(N, q.device)  # the encoder's call before each forward pass
        attn(q, k, v, mask)
        seen.append(attn.projection.clone())
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert changed == [False, False, True, False, True]
    attn.eval()
    before = attn.projection.clone()
    for _ in range(4):
        attn.prepare(N, q.device)
        attn(q, k, v, mask)
    assert torch.equal(before, attn.projection)
    model = Encoder(cfg("performer", performer_redraw_interval=1))
    layer_attn = model.layers[0].attention.attn
    model.eval()
    before = layer_attn.projection.clone()
    ids = torch.randint(0, 40, (2, 20))
    model(ids)
    assert torch.equal(before, layer_attn.projection)
    model.train()
    model(ids)
    model(ids)
    assert not torch.equal(before, layer_attn.projection)  # the encoder counts its training passes
    # Rows of one block are orthogonal.
    from nystromformer.attention.performer import orthogonal_gaussian
    w = orthogonal_gaussian(D, D, dtype=torch.float64)
    gram = w @ w.T
    torch.testing.assert_close(gram - torch.diag(torch.diag(gram)), torch.zeros(D, D, dtype=torch.float64),
                               atol=1e-10, rtol=0)


def test_performer_random_features_are_unbiased():
    # Rows are N(0, I) marginally (orthogonal within a block), so E[φ(q)ᵀφ(k)] = exp(q·k): averaged over draws,
    # the estimate converges to the kernel (QR without its sign fix gives a first row that always points one way).
    from nystromformer.attention.performer import orthogonal_gaussian
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([orthogonal_gaussian(D, D, generator=g, dtype=torch.float64) for _ in range(4000)])
    assert draws.mean(0).abs().max() < 0.1  # each entry ~ N(0, 1): standard error 0.016
    x, y = 0.8 * torch.randn(2, D, generator=g, dtype=torch.float64) / D ** 0.5  # norms ~0.8: a light-tailed estimate
    def phi(z, w):  # positive_features without its stabiliser and eps (which cancel or vanish in attention)
        return torch.exp(w @ z - 0.5 * z @ z) / w.shape[0] ** 0.5
    mean = torch.stack([phi(x, w) @ phi(y, w) for w in draws]).mean()
    assert abs(mean / torch.exp(x @ y) - 1) < 0.02, (mean, torch.exp(x @ y))


def test_performer_row_of_only_padding_stays_finite():
    attn = build_attention(cfg("performer")).double()
    q, k, v = (t.requires_grad_() for t in qkv())
    mask = padded_mask()
    mask[0] = 0
    out = attn(q, k, v, mask)
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_longformer_equals_softmax_for_wide_window_and_band_pattern_otherwise():
    q, k, v = qkv()
    mask = padded_mask()
    allowed_pad = mask.bool()[:, None, None, :]
    wide = build_attention(cfg("longformer", window_size=2 * N, num_global_tokens=0))
    torch.testing.assert_close(wide(q, k, v, mask), dense_softmax(q, k, v, allowed_pad))
    for w, g in ((6, 1), (4, 2), (3, 0), (7, 3)):
        attn = build_attention(cfg("longformer", window_size=w, num_global_tokens=g))
        i = torch.arange(N)
        pattern = ((i[:, None] - i[None, :]).abs() <= w // 2) | (i[None, :] < g) | (i[:, None] < g)
        expected = dense_softmax(q, k, v, pattern[None, None] & allowed_pad)
        real = mask.bool()  # a padded query may see no real key at all (NaN in the dense reference)
        torch.testing.assert_close(attn(q, k, v, mask).transpose(1, 2)[real], expected.transpose(1, 2)[real])


def test_bigbird_equals_dense_softmax_with_same_block_pattern():
    torch.manual_seed(0)
    for n, bs, r, g in ((24, 4, 1, 1), (22, 4, 2, 2), (30, 5, 1, 0), (8, 4, 3, 1)):
        attn = build_attention(cfg("bigbird", block_size=bs, bigbird_num_random_blocks=r,
                                   bigbird_num_global_blocks=g))
        q, k, v = qkv(n)
        mask = padded_mask(n, real=(n, n - 5))
        nb = -(-n // bs)
        pat = attn.block_pattern(nb)
        blk = torch.arange(n) // bs
        token_pattern = pat[blk[:, None], blk[None, :]]
        expected = dense_softmax(q, k, v, token_pattern[None, None] & mask.bool()[:, None, None, :])
        torch.testing.assert_close(attn(q, k, v, mask), expected)
        # The pattern is window + global + r random blocks per non-global row (when there is room).
        for row in range(min(g, nb), nb):
            assert pat[row].sum() <= 3 + min(g, nb) + r
        if nb > 3 + g + r:  # a middle row far from the global blocks has exactly window + global + random
            assert pat[nb // 2 + 1].sum() == 3 + g + r or nb // 2 + 1 >= nb - 1 or nb // 2 - 1 <= g


def test_linformer_identity_projection_is_softmax_and_sharing_shapes():
    n = 32  # = max_seq_len
    attn = build_attention(cfg("linformer", linformer_k=n, linformer_sharing="headwise"))
    with torch.no_grad():
        attn.proj.E.copy_(torch.eye(n)[None])
        attn.proj.F.copy_(torch.eye(n)[None])
    attn.double()
    q, k, v = qkv(n)
    ones = torch.ones(B, n, dtype=torch.long)
    torch.testing.assert_close(attn(q, k, v, ones), dense_softmax(q, k, v, ones.bool()[:, None, None, :]))
    # Shorter inputs use the first n columns of E and F.
    q, k, v = qkv(10)
    ones = torch.ones(B, 10, dtype=torch.long)
    # Rows of E beyond the 10 columns used project to zero keys (with zero values): softmax weight exp(0) each.
    zero_keys = torch.zeros(B, H, n - 10, D, dtype=k.dtype)
    expected = torch.softmax(q @ torch.cat([k, zero_keys], 2).transpose(-1, -2) / math.sqrt(D), -1)[..., :10] @ v
    torch.testing.assert_close(attn(q, k, v, ones), expected)
    # Padding is exact: padded positions add nothing to the projections, so a padded row's real tokens get the
    # output of the same row unpadded (E, F sliced to its length) — zero keys included, as above: Linformer is not
    # a masked softmax over tokens.
    mask = padded_mask(n, real=(n, 20))
    q, k, v = qkv(n)
    out = attn(q, k, v, mask)
    unpadded = attn(q[1:, :, :20], k[1:, :, :20], v[1:, :, :20], torch.ones(1, 20, dtype=torch.long))
    torch.testing.assert_close(out[1:, :, :20], unpadded)
    for sharing, shape_e, has_f in (("none", (H, 8, 32), True), ("headwise", (1, 8, 32), True), ("kv", (1, 8, 32), False)):
        a = build_attention(cfg("linformer", linformer_sharing=sharing))
        assert tuple(a.proj.E.shape) == shape_e and (a.proj.F is not None) == has_f


def test_linformer_revisited_matches_its_definition():
    attn = build_attention(cfg("linformer_revisited", linformer_sharing="none")).double()
    q, k, v = qkv()
    mask = padded_mask()
    keep = mask[:, None, :, None].double()
    e = attn.proj.E[..., :N].double()
    f = attn.proj.F[..., :N].double()
    kh, vh = e @ (k * keep), f @ (v * keep)
    s = D ** -0.25
    expected = torch.zeros_like(v)
    for bi in range(B):
        for hi in range(H):
            a = torch.softmax(q[bi, hi] * s, dim=1)                # n × d, rows sum to 1
            bmat = torch.softmax(kh[bi, hi] * s, dim=0)            # k × d, columns sum to 1
            expected[bi, hi] = a @ bmat.T @ vh[bi, hi]
    torch.testing.assert_close(attn(q, k, v, mask), expected)


def test_reformer_single_chunk_is_shared_qk_softmax_without_self():
    for hashes in (1, 3):
        attn = build_attention(cfg("reformer", reformer_bucket_size=32, reformer_num_hashes=hashes))
        q, k, v = qkv(20)
        mask = padded_mask(20, real=(20, 13))
        keys = torch.nn.functional.normalize(q, dim=-1)                 # shared QK: k is ignored
        scores = q @ keys.transpose(-1, -2) / math.sqrt(D)
        allowed = mask.bool()[:, None, None, :] & ~torch.eye(20, dtype=torch.bool)
        expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
        real = mask.bool()
        out = attn(q, k, v, mask)
        torch.testing.assert_close(out.transpose(1, 2)[real], expected.transpose(1, 2)[real])


def test_reformer_multi_chunk_attends_within_buckets():
    # Two well-separated clusters of directions hash apart: each query's output mixes only its cluster's values.
    torch.manual_seed(0)
    attn = build_attention(cfg("reformer", reformer_bucket_size=4, reformer_num_hashes=2))
    n = 16
    base = torch.zeros(1, 1, n, D, dtype=torch.float64)
    base[..., :8, 0] = 5.0
    base[..., 8:, 0] = -5.0
    q = (base + 0.01 * torch.randn(1, 1, n, D, dtype=torch.float64)).expand(1, H, n, D).contiguous()
    v = torch.zeros(1, H, n, D, dtype=torch.float64)
    v[..., :8, 1] = 1.0
    v[..., 8:, 2] = 1.0
    out = attn(q, q, v, torch.ones(1, n, dtype=torch.long))
    # cluster A outputs mostly value-direction 1, cluster B mostly direction 2
    assert (out[..., :8, 1] > out[..., :8, 2]).float().mean() > 0.9
    assert (out[..., 8:, 2] > out[..., 8:, 1]).float().mean() > 0.9


def test_reformer_buckets_are_the_argmax_over_both_signs_including_ties():
    from nystromformer.attention.reformer import lsh_buckets
    g = torch.Generator().manual_seed(0)
    for rounded in (False, True):  # rounding makes ties, within and across the two halves
        r = torch.randn(4, 3, 50, 8, generator=g)
        r = r.round() if rounded else r
        assert torch.equal(lsh_buckets(r), torch.cat([r, -r], dim=-1).argmax(dim=-1))


def naive_reformer(q, v, mask, bucket_size, rounds, rotation):
    """Reformer's definition with loops, for a given rotation (h, d, rounds, nb/2): per round, positions sorted by
    (bucket, position; padding last) and cut into chunks of c; each chunk attends to itself and the chunk before
    it in the sequence of all rounds' chunks (wrapping round); self only when nothing else; rounds weighted by the
    softmax of their log-sum-exps."""
    b, h, n, d = q.shape
    c, nb = bucket_size, 2 * rotation.shape[-1]
    keys = torch.nn.functional.normalize(q, dim=-1) / math.sqrt(d)
    out = torch.zeros_like(v)
    for bi in range(b):
        for hi in range(h):
            chunks = []  # (round, positions) in the order of the concatenated rounds
            for r in range(rounds):
                x = q[bi, hi] @ rotation[hi, :, r]
                buckets = [int(torch.cat([x[i], -x[i]]).argmax()) if mask[bi, i] else nb for i in range(n)]
                order = sorted(range(n), key=lambda i: (buckets[i], i))
                chunks += [(r, order[j:j + c]) for j in range(0, n, c)]
            per_round = {i: [] for i in range(n)}
            for j, (r, members) in enumerate(chunks):
                seen = members + (chunks[j - 1][1] if len(chunks) > 1 else [])
                for i in members:
                    scores = torch.stack([torch.tensor(-1e5, dtype=q.dtype) if key == i
                                          else q[bi, hi, i] @ keys[bi, hi, key] for key in seen])
                    scores = scores.masked_fill(~mask[bi, seen].bool(), float("-inf"))
                    per_round[i].append((torch.logsumexp(scores, 0), torch.softmax(scores, 0) @ v[bi, hi, seen]))
            for i in range(n):
                lse = torch.stack([l for l, _ in per_round[i]])
                out[bi, hi, i] = sum(w * o for w, (_, o) in zip(torch.softmax(lse, 0), per_round[i]))
    return out


def chunked_reformer():
    """Two hash rounds over 16 positions in chunks of 4 (nb = 4 buckets), the second row padded after 11."""
    q, k, v = qkv(16)
    mask = padded_mask(16, real=(16, 11))
    return build_attention(cfg("reformer", reformer_bucket_size=4, reformer_num_hashes=2)), q, k, v, mask


def test_reformer_with_several_chunks_and_hashes_is_its_definition():
    attn, q, k, v, mask = chunked_reformer()
    torch.manual_seed(5)
    out = attn(q, k, v, mask)
    torch.manual_seed(5)  # the same rotation: (h, d, rounds, nb/2), nb = 4 chunks per round
    rotation = torch.randn(H, D, 2, 2, dtype=q.dtype)
    expected = naive_reformer(q, v, mask, 4, 2, rotation)
    real = mask.bool()
    torch.testing.assert_close(out.transpose(1, 2)[real], expected.transpose(1, 2)[real], rtol=1e-10, atol=1e-12)


def test_reformer_hashes_afresh_in_training_and_the_same_way_in_every_evaluation():
    # A dev score or test prediction must not depend on torch's RNG state or on an example's batch mates.
    attn, q, k, v, mask = chunked_reformer()
    torch.manual_seed(0)
    first = attn(q, k, v, mask)
    assert not torch.allclose(attn(q, k, v, mask), first)  # training: a new rotation each forward

    attn.eval()
    torch.manual_seed(0)
    evaluated = attn(q, k, v, mask)
    torch.manual_seed(1)
    torch.testing.assert_close(attn(q, k, v, mask), evaluated, rtol=0, atol=0)
    expected = naive_reformer(q, v, mask, 4, 2, attn.rotation((H, D, 2, 2), q.device, q.dtype))
    real = mask.bool()
    torch.testing.assert_close(evaluated.transpose(1, 2)[real], expected.transpose(1, 2)[real], rtol=1e-10,
                               atol=1e-12)
    for i in range(B):  # each example alone gives what it gave in the batch
        torch.testing.assert_close(attn(q[i:i + 1], k[i:i + 1], v[i:i + 1], mask[i:i + 1]), evaluated[i:i + 1],
                                   rtol=1e-12, atol=1e-12)
    another = build_attention(cfg("reformer", reformer_bucket_size=4, reformer_num_hashes=2)).eval()
    torch.testing.assert_close(another(q, k, v, mask), evaluated, rtol=0, atol=0)  # e.g. in another process
    single = another(q.float(), k.float(), v.float(), mask)  # the same rotation in any dtype (so the same buckets)
    torch.testing.assert_close(single.double(), evaluated, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(ATTENTION_REGISTRY))
def test_the_variants_whose_outputs_depend_on_the_amount_of_padding_are_declared_so(name):
    # GLUE pads these to one fixed length (glue/finetune.py, collator): the declaration must match the behaviour.
    from nystromformer.attention import PADDING_AMOUNT_MATTERS
    torch.manual_seed(0)
    attn = build_attention(cfg(name, num_landmarks=4)).double()
    attn.eval()
    q, k, v = qkv(n=32)
    outs = []
    for n in (24, 32):  # the same 20 real tokens, padded to 24 or to 32
        mask = torch.zeros(B, n, dtype=torch.long)
        mask[:, :20] = 1
        torch.manual_seed(1)  # the same random rotations / features for both
        outs.append(attn(q[:, :, :n], k[:, :, :n], v[:, :, :n], mask)[:, :, :20])
    same = torch.allclose(outs[0], outs[1], atol=1e-10, rtol=1e-10)
    assert same == (name not in PADDING_AMOUNT_MATTERS), name


@pytest.mark.parametrize("attn_type", VARIANTS)
def test_fp32_inputs_under_bf16_autocast_run_and_match_fp32(attn_type):
    # Autocast's matmuls give bf16 scores from fp32 q and k: a masked fill with fp32's minimum overflowed bf16.
    torch.manual_seed(0)
    attn = build_attention(cfg(attn_type)).eval()
    q, k, v = qkv(dtype=torch.float32)
    mask = padded_mask()
    exact = attn(q, k, v, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(q, k, v, mask)
    real = mask.bool()
    torch.testing.assert_close(out.float().transpose(1, 2)[real], exact.transpose(1, 2)[real], atol=0.05, rtol=0.05)


def test_reformer_evaluation_rotation_does_not_depend_on_the_lengths_evaluated_before():
    # Seeded by the bucket count alone: a module that first evaluated another length hashes this one as a fresh one.
    attn, q, k, v, mask = chunked_reformer()
    attn.eval()
    q8, k8, v8 = qkv(8)
    attn(q8, k8, v8, padded_mask(8, real=(8, 5)))  # another length first (another bucket count)
    fresh = build_attention(cfg("reformer", reformer_bucket_size=4, reformer_num_hashes=2)).eval()
    torch.testing.assert_close(attn(q, k, v, mask), fresh(q, k, v, mask), rtol=0, atol=0)


def test_reformer_bucket_count_is_the_chunk_count_rounded_up_to_even():
    # 12 positions in chunks of 4: 3 chunks, 4 buckets (a rotation of 4 / 2 columns), as the docstring defines.
    attn = build_attention(cfg("reformer", reformer_bucket_size=4, reformer_num_hashes=2))
    assert attn.rotation_shape(12, H) == (H, D, 2, 2)
    assert attn.rotation_shape(9, H) == (H, D, 2, 2) and attn.rotation_shape(4, H) == (H, D, 2, 1)
    q, k, v = qkv(12)
    mask = padded_mask(12, real=(12, 9))
    torch.manual_seed(5)
    out = attn(q, k, v, mask)
    torch.manual_seed(5)
    expected = naive_reformer(q, v, mask, 4, 2, torch.randn(H, D, 2, 2, dtype=q.dtype))
    real = mask.bool()
    torch.testing.assert_close(out.transpose(1, 2)[real], expected.transpose(1, 2)[real], rtol=1e-10, atol=1e-12)
