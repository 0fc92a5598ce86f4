"""Nyström attention against its oracle, exact softmax attention, in float64 on random inputs."""
import pytest
import torch

from nystromformer.attention import build_attention
from nystromformer.attention.nystrom import iterative_pinv, segment_means
from nystromformer.config import ModelConfig

B, H, D = 2, 3, 16


def config(**kw) -> ModelConfig:
    return ModelConfig(num_head=H, head_dim=D, transformer_dim=H * D, **kw)


def exact_attention(q, k, v, mask):
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for _ in range(3)]


def relative_error(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("n,landmarks", [(64, 64), (48, 64), (50, 50)])
def test_nystrom_is_exact_softmax_when_landmarks_cover_the_sequence(n, landmarks):
    q, k, v = qkv(n)
    mask = torch.ones(B, n, dtype=torch.float64)
    mask[1, n - 7:] = 0
    out = build_attention(config(num_landmarks=landmarks)).double()(q, k, v, mask)
    ref = exact_attention(q, k, v, mask)
    assert torch.allclose(out[0], ref[0], atol=1e-12)
    assert torch.allclose(out[1, :, : n - 7], ref[1, :, : n - 7], atol=1e-12)


def test_softmax_variant_is_exact_attention_with_key_padding():
    n = 40
    q, k, v = qkv(n)
    mask = torch.ones(B, n, dtype=torch.float64)
    mask[0, 30:] = 0
    out = build_attention(config(attn_type="softmax"))(q, k, v, mask)
    assert relative_error(out, exact_attention(q, k, v, mask)) < 1e-12


def test_approximation_error_falls_as_landmarks_grow():
    n = 128
    q, k, v = qkv(n, seed=1)
    mask = torch.ones(B, n, dtype=torch.float64)
    ref = exact_attention(q, k, v, mask)
    errors = [relative_error(build_attention(config(num_landmarks=m)).double()(q, k, v, mask), ref)
              for m in (4, 8, 16, 32, 64, 128)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-12


@pytest.mark.parametrize("init", ["original", "exact"])
def test_pseudo_inverse_residual_is_small_for_every_matrix(init):
    g = torch.Generator().manual_seed(2)
    m = 16
    # Softmax kernels with a dominant diagonal: well conditioned, as the iteration's convergence needs.
    scores = 3.0 * torch.eye(m, dtype=torch.float64) + 0.5 * torch.randn(4, H, m, m, generator=g, dtype=torch.float64)
    a = torch.softmax(scores, dim=-1)
    z = iterative_pinv(a, num_iterations=6, init=init)
    residual = (torch.eye(m, dtype=torch.float64) - a @ z).flatten(-2).norm(dim=-1)
    assert residual.max() < 1e-8, residual.max()
    assert torch.allclose(z, torch.linalg.pinv(a), atol=1e-8)


def test_exact_init_is_per_matrix_while_original_init_depends_on_batch_mates():
    g = torch.Generator().manual_seed(3)
    m = 8
    sharp = torch.softmax(6 * torch.randn(1, 1, m, m, generator=g, dtype=torch.float64), dim=-1)
    flat = torch.softmax(0.1 * torch.randn(1, 1, m, m, generator=g, dtype=torch.float64), dim=-1)
    batch = torch.cat([flat, sharp])
    alone = iterative_pinv(flat, 2, "exact")
    assert torch.allclose(iterative_pinv(batch, 2, "exact")[0], alone, atol=1e-14)
    # The paper's code scales by the largest column sum over the whole batch (reproduced, documented).
    assert not torch.allclose(iterative_pinv(batch, 2, "original")[0], iterative_pinv(flat, 2, "original"))


@pytest.mark.parametrize("impl", ["reference", "fast"])  # "fast": on the CPU, the GPU path's PyTorch ops
@pytest.mark.parametrize("conv", [None, 5])
def test_original_init_over_groups_of_rows_is_one_pass_per_group(conv, impl):
    # init_rows: what pretraining sets (inst_per_gpu), so that one pass over several micro-batches' rows computes
    # what a pass per micro-batch computes, the pseudo-inverse's batch max included. 5 rows in groups of 2.
    att = build_attention(config(num_landmarks=8, conv_kernel_size=conv)).double()
    att.impl = impl
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(5, H, 40, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    mask = torch.ones(5, 40, dtype=torch.float64)
    mask[1, 30:] = mask[4, 11:] = 0
    att.init_rows = 2
    grouped = att(q, k, v, mask)
    att.init_rows = None
    per_group = torch.cat([att(q[i:i + 2], k[i:i + 2], v[i:i + 2], mask[i:i + 2]) for i in range(0, 5, 2)])
    assert relative_error(grouped, per_group) < 1e-13
    gout = torch.randn(grouped.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(grouped, (q, k, v), gout), torch.autograd.grad(per_group, (q, k, v), gout)):
        assert relative_error(a, b) < 1e-13
    whole_batch = att(q, k, v, mask)
    assert relative_error(whole_batch, per_group) > 1e-6   # the whole batch's max: other outputs
    att.init_rows = 5   # a group as large as the batch is the batch
    assert torch.equal(att(q, k, v, mask), whole_batch)


def test_original_init_over_groups_splits_a_groups_max_gradient_evenly_over_its_tied_column_sums():
    # In the group of rows 0-1, matrix 0 has two columns at the max and matrix 1 one: each of the three gets a
    # third, as torch.max over that group alone gives (a max per matrix, then per group, would give 1/4, 1/4, 1/2).
    from nystromformer.attention.nystrom import pinv_init
    a = torch.full((3, 1, 3, 3), 0.1, dtype=torch.float64)
    a[0, 0, :, :2] = 0.5     # column sums 1.5, 1.5, 0.3
    a[1, 0, :, 0] = 0.5      # 1.5, 0.3, 0.3
    a[2, 0, :, 1] = 0.2      # the second group, alone
    a.requires_grad_()
    grouped = pinv_init(a, "original", init_rows=2)
    per_group = torch.cat([pinv_init(a[:2], "original"), pinv_init(a[2:], "original")])
    gout = torch.randn(a.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (da,), (db,) = torch.autograd.grad(grouped, a, gout), torch.autograd.grad(per_group, a, gout)
    assert torch.allclose(da, db, rtol=1e-14, atol=1e-15)
    with pytest.raises(ValueError, match="init_rows: must be >= 1"):
        pinv_init(a, "original", init_rows=0)


def test_original_init_over_groups_splits_the_max_gradient_over_each_groups_ties():
    from nystromformer.attention.nystrom import pinv_init
    a = torch.softmax(torch.zeros(4, 2, 5, 5, dtype=torch.float64), -1).requires_grad_()  # every column sum ties
    grouped = pinv_init(a, "original", init_rows=3)
    per_group = torch.cat([pinv_init(a[:3], "original"), pinv_init(a[3:], "original")])
    assert torch.equal(grouped, per_group)
    gout = torch.randn(a.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (da,), (db,) = torch.autograd.grad(grouped, a, gout), torch.autograd.grad(per_group, a, gout)
    assert torch.allclose(da, db, rtol=1e-14, atol=1e-15)


def test_the_initial_guesses_are_the_transpose_over_the_papers_norms():
    from nystromformer.attention.nystrom import pinv_init
    a = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)  # not stochastic
    norm_1, norm_inf = (torch.linalg.matrix_norm(a, ord) for ord in (1, float("inf")))
    assert torch.allclose(pinv_init(a, "exact"), a.mT / (norm_1 * norm_inf)[..., None, None], rtol=1e-14)
    # the authors' code: the largest column sum of the whole batch (‖A‖∞ = 1 for a softmax)
    assert torch.allclose(pinv_init(a, "original"), a.mT / a.sum(dim=-2).max(), rtol=1e-14)


def test_more_pinv_iterations_converge_further():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 16, 8, generator=g, dtype=torch.float64)
    a = torch.softmax(x @ x.transpose(-1, -2) / 4, dim=-1)
    eye = torch.eye(16, dtype=torch.float64)
    residuals = [(eye - a @ iterative_pinv(a, it, "exact")).norm().item() for it in (2, 6, 12)]
    assert residuals[0] > residuals[1] > residuals[2]


@pytest.mark.parametrize("n,m", [(50, 8), (37, 5), (100, 64)])
def test_uneven_segments_average_contiguous_runs_differing_by_at_most_one(n, m):
    x = torch.randn(2, n, 4, dtype=torch.float64)
    means = segment_means(x, m)
    bounds = [(-(-i * n // m)) for i in range(m + 1)]  # ceil(i n / m)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        assert torch.allclose(means[:, i], x[:, a:b].mean(dim=1), atol=1e-12)


def test_sequence_lengths_not_divisible_by_landmarks_work_and_have_gradients():
    n = 61
    q, k, v = [t.requires_grad_() for t in qkv(n)]
    mask = torch.ones(B, n, dtype=torch.float64)
    out = build_attention(config(num_landmarks=8, conv_kernel_size=5)).double()(q, k, v, mask)
    out.sum().backward()
    assert out.shape == v.shape and torch.isfinite(out).all()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("attn_type,landmarks", [("softmax", 8), ("nystrom", 8), ("nystrom", 64)])
def test_contents_of_padded_positions_never_change_real_outputs(attn_type, landmarks):
    n, real = 48, 35
    q, k, v = qkv(n)
    mask = torch.ones(B, n, dtype=torch.float64)
    mask[:, real:] = 0
    attn = build_attention(config(attn_type=attn_type, num_landmarks=landmarks, conv_kernel_size=5)).double()
    out = attn(q, k, v, mask)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, :, real:] = 100 * torch.randn_like(t[:, :, real:])
    out2 = attn(q2, k2, v2, mask)
    assert torch.allclose(out[:, :, :real], out2[:, :, :real], atol=1e-12)


def test_softmax_outputs_do_not_depend_on_the_amount_of_padding():
    n, extra = 30, 18
    q, k, v = qkv(n)
    attn = build_attention(config(attn_type="softmax"))
    short = attn(q, k, v, torch.ones(B, n, dtype=torch.float64))
    pad = lambda t: torch.cat([t, torch.randn(B, H, extra, D, dtype=t.dtype)], dim=2)  # noqa: E731
    mask = torch.cat([torch.ones(B, n), torch.zeros(B, extra)], dim=1).double()
    long = attn(pad(q), pad(k), pad(v), mask)
    assert torch.allclose(long[:, :, :n], short, atol=1e-12)


def test_nystrom_padding_amount_shifts_landmarks_as_documented():
    # Segment means run over the padded length, so extra padding changes real outputs (a property of
    # the algorithm, documented in attention/nystrom.py) -- but only through the landmarks.
    n, extra = 32, 32
    q, k, v = qkv(n)
    attn = build_attention(config(num_landmarks=8)).double()
    short = attn(q, k, v, torch.ones(B, n, dtype=torch.float64))
    pad = lambda t: torch.cat([t, torch.zeros(B, H, extra, D, dtype=t.dtype)], dim=2)  # noqa: E731
    mask = torch.cat([torch.ones(B, n), torch.zeros(B, extra)], dim=1).double()
    long = attn(pad(q), pad(k), pad(v), mask)
    assert torch.isfinite(long).all()
    assert not torch.allclose(long[:, :, :n], short)


@pytest.mark.parametrize("n,kernel", [(256, 33), (512, 65)])
def test_the_conv_weight_gradient_in_fp32_is_that_of_fp64(n, kernel):
    # The paper's kernel sizes at pretraining lengths. On x86 CPUs oneDNN's depthwise Conv2d kernel gets this
    # gradient 4-10% wrong here; the reference computes the same convolution as a grouped conv1d.
    attn = build_attention(config(num_landmarks=16, conv_kernel_size=kernel))
    q, k, v = qkv(n)
    g = qkv(n, seed=1)[0]
    grads = {}
    for dtype in (torch.float64, torch.float32):
        attn.to(dtype).zero_grad()
        attn.reference_forward(q.to(dtype), k.to(dtype), v.to(dtype), None).backward(g.to(dtype))
        grads[dtype] = attn.conv.weight.grad.double()
    assert relative_error(grads[torch.float32], grads[torch.float64]) < 1e-5


def test_depthwise_conv_skip_adds_a_per_head_sequence_convolution_of_v():
    n = 32
    q, k, v = qkv(n)
    mask = torch.ones(B, n, dtype=torch.float64)
    with_conv = build_attention(config(num_landmarks=64, conv_kernel_size=3)).double()
    torch.nn.init.zeros_(with_conv.conv.weight)
    with_conv.conv.weight.data[:, 0, 1, 0] = 1.0  # identity kernel: out = attention + v
    assert torch.allclose(with_conv(q, k, v, mask), exact_attention(q, k, v, mask) + v, atol=1e-12)
    assert tuple(with_conv.conv.weight.shape) == (H, 1, 3, 1)
