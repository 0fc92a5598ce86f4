"""The Nyströmformer model: a RoBERTa-style post-LayerNorm encoder, as in the paper's code (pre-LayerNorm
blocks with a final LayerNorm, as in the paper's LRA code, with ``pre_layer_norm``).

Embeddings (word + learned position with RoBERTa's offset of 2 + token type) → LayerNorm → dropout →
``num_layers`` blocks of [multi-head attention → dropout → add & LayerNorm → GELU FFN → dropout → add &
LayerNorm]. The attention kernel is chosen by ``attn_type`` (see ``nystromformer.attention``). Heads: an
MLM head tied to the word embeddings, and a first-token sequence head for fine-tuning.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .attention import build_attention
from .config import ModelConfig

# RoBERTa numbers positions from padding_idx + 1 = 2; rows 0 and 1 of the table are never used for tokens.
POSITION_OFFSET = 2
IGNORE_INDEX = -100


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.embedding_dim)
        self.position_embeddings = nn.Embedding(cfg.max_seq_len + POSITION_OFFSET, cfg.embedding_dim)
        self.token_type_embeddings = nn.Embedding(cfg.num_sen_type, cfg.embedding_dim)
        self.norm = nn.LayerNorm(cfg.embedding_dim, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor]) -> torch.Tensor:
        n = input_ids.shape[1]
        positions = torch.arange(POSITION_OFFSET, n + POSITION_OFFSET, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.norm(x))


class MultiHeadAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_head, self.head_dim = cfg.num_head, cfg.head_dim
        inner = cfg.num_head * cfg.head_dim
        self.query = nn.Linear(cfg.transformer_dim, inner)
        self.key = nn.Linear(cfg.transformer_dim, inner)
        self.value = nn.Linear(cfg.transformer_dim, inner)
        self.output = nn.Linear(inner, cfg.transformer_dim)
        self.attn = build_attention(cfg)
        self.reads_keys = getattr(self.attn, "reads_keys", True)
        self.attention_fp32 = cfg.attention_fp32
        self.grad_checkpointing = cfg.attention_grad_checkpointing
        self._fixed: Optional[dict] = None  # the joined weights of a fixed_weights() block

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v as one (b, n, 3, h, d) product: the three projections' weights are joined for it, so under
        autocast x is cast once (not once per projection, each cast kept for the backward), and the backward is
        one product for dx and one for the weights, the gradients of q, k and v joined by one copy. For a variant
        that reads no keys (Reformer's shared QK) k is not computed — (b, n, 2, h, d), q and v — so the key
        projection gets no gradient (and no weight decay), as with separate projections."""
        b, n, _ = x.shape
        linears = (self.query, self.key, self.value) if self.reads_keys else (self.query, self.value)
        weight, bias = self.joined_weights(linears)
        return F.linear(x, weight, bias).view(b, n, len(linears), self.num_head, self.head_dim)

    def joined_weights(self, linears) -> tuple[torch.Tensor, torch.Tensor]:
        """The projections' weights and biases joined. Inside ``fixed_weights`` they are joined once — under
        autocast already cast to its dtype, as F.linear would — and every pass of the block reuses them (autocast's
        own cache does the same for the other layers' weights, which are leaves; these are not)."""
        if torch.compiler.is_compiling() or self._fixed is None:  # compiled: inductor fuses the casts itself
            return torch.cat([linear.weight for linear in linears]), torch.cat([linear.bias for linear in linears])
        device_type = linears[0].weight.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        key = (dtype, torch.is_grad_enabled())  # made without grad, they would give the weights no gradient
        versions = [p._version for linear in linears for p in (linear.weight, linear.bias)]
        if key in self._fixed:
            made_at, joined = self._fixed[key]
            if made_at != versions:
                raise RuntimeError("a q/k/v projection weight changed in place inside fixed_weights(): its joined "
                                   "copy would be stale (step the optimizer outside the block)")
            return joined
        joined = (torch.cat([linear.weight for linear in linears]), torch.cat([linear.bias for linear in linears]))
        if dtype is not None:
            joined = tuple(t.to(dtype) for t in joined)
        self._fixed[key] = (versions, joined)
        return joined

    def _core(self, qkv, mask):
        device_type = qkv.device.type
        if self.attention_fp32 and torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):  # one cast of q, k and v together
                return self.attn(*heads(qkv.float()), mask).to(qkv.dtype)
        return self.attn(*heads(qkv), mask)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.project(x)
        if self.grad_checkpointing and self.training:
            out = checkpoint(self._core, qkv, mask, use_reentrant=False)
        else:
            out = self._core(qkv, mask)
        return self.output(out.transpose(1, 2).reshape(b, n, self.num_head * self.head_dim))


def heads(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as (b, h, n, d) views of the joined (b, n, 3, h, d) projection (the attention interface's shape);
    from a (b, n, 2, h, d) one without keys, q stands in for k (the variant does not read it)."""
    parts = [t.transpose(1, 2) for t in qkv.unbind(2)]
    return tuple(parts) if len(parts) == 3 else (parts[0], parts[0], parts[1])


@contextlib.contextmanager
def fixed_weights(model: nn.Module):
    """A block of forward (and backward) passes in which no weight changes — one optimizer step's micro-batches,
    an evaluation: each layer's joined q, k, v weight, and under autocast its cast, is made once for the block
    instead of once per pass. Give the block one autocast region too (not one per pass) and autocast's cache does
    the same for every other weight's cast. The results are bitwise those of separate passes. A projection weight
    changed in place inside the block (an optimizer step) is an error, not a stale copy — except through ``.data``,
    which autograd's version counter does not see (nor autocast's cache). Blocks nest: an inner one shares the
    outer one's copies."""
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    outer = [layer._fixed for layer in layers]
    for layer in layers:
        layer._fixed = {} if layer._fixed is None else layer._fixed
    try:
        yield
    finally:
        for layer, before in zip(layers, outer):
            layer._fixed = before


def set_batch_groups(model: nn.Module, rows: Optional[int]) -> None:
    """Take the batch-wide statistics of ``model``'s attention (Nyström's ``"original"`` pseudo-inverse init: a max
    over the batch) over each group of ``rows`` consecutive rows of a pass instead (None: the whole pass). With
    ``rows`` = the recipe's micro-batch, a pass over several micro-batches' rows then computes what a pass per
    micro-batch would, in fewer, larger passes (``gpu_setting.rows_per_pass``). Variants without such a statistic
    have no ``init_rows`` and are left alone."""
    if rows is not None and rows < 1:
        raise ValueError(f"batch groups: rows must be >= 1 (or None for the whole pass), got {rows}")
    for module in model.modules():
        if hasattr(module, "init_rows"):
            module.init_rows = rows


def activation(cfg: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model.hidden_act``: the tanh approximation of GELU (the authors') or the exact erf GELU."""
    return functools.partial(F.gelu, approximate="tanh" if cfg.hidden_act == "gelu_tanh" else "none")


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense_in = nn.Linear(cfg.transformer_dim, cfg.transformer_hidden_dim)
        self.dense_out = nn.Linear(cfg.transformer_hidden_dim, cfg.transformer_dim)
        self.act = activation(cfg)
        self.grad_checkpointing = cfg.gelu_grad_checkpointing

    def _hidden(self, x):
        return self.act(self.dense_in(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and self.training:
            # The (n, 4d) GELU activations dominate memory; recompute them in backward.
            return self.dense_out(checkpoint(self._hidden, x, use_reentrant=False))
        return self.dense_out(self._hidden(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = MultiHeadAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.transformer_dim, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)
        self.norm2 = nn.LayerNorm(cfg.transformer_dim, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout_prob)
        self.pre_layer_norm = cfg.pre_layer_norm

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        if self.pre_layer_norm:
            x = x + self.dropout(self.attention(self.norm1(x), mask))
            return x + self.dropout(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.dropout(self.attention(x, mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.embedding_projection = (nn.Linear(cfg.embedding_dim, cfg.transformer_dim)
                                     if cfg.embedding_dim != cfg.transformer_dim else None)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.transformer_dim, eps=cfg.layer_norm_eps) if cfg.pre_layer_norm else None
        # variants with a prepare(): their random state is advanced or looked up once per pass, before any layer
        self._prepared = [layer.attention.attn for layer in self.layers if hasattr(layer.attention.attn, "prepare")]

    @torch.compiler.disable
    def prepare_attention(self, input_ids: torch.Tensor) -> None:
        """The variants' per-pass host work (Performer's redraw count, BigBird's block layout, Reformer's evaluation
        rotation), run eagerly: compiled, it would split the encoder's graph at every layer; outside the variant's
        forward, which gradient checkpointing's backward runs again."""
        for attn in self._prepared:  # (the ids, not their length: a dynamic length would be a graph of its own)
            attn.prepare(input_ids.shape[1], input_ids.device)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds model.max_seq_len "
                             f"{self.config.max_seq_len}")
        if self._prepared:  # a Python constant: the other variants trace no call (no graph break)
            self.prepare_attention(input_ids)
        # attention_mask None = no padding: the attention variants skip the masking work (see attention/__init__).
        x = self.embeddings(input_ids, token_type_ids)
        if self.embedding_projection is not None:
            x = self.embedding_projection(x)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return x if self.final_norm is None else self.final_norm(x)


def init_weights(module: nn.Module, scheme: str = "bert", std: float = 0.02) -> None:
    """``model.weight_init``. "bert" (BERT/RoBERTa): N(0, 0.02) weights, zero biases, unit LayerNorm. "paper" (the
    authors' code): N(0, 0.02) embeddings, PyTorch's default init for linear layers (uniform weights and biases),
    unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            if scheme == "paper":
                m.reset_parameters()
                continue
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


@dataclass
class MLMOutput:
    loss: torch.Tensor          # mean cross-entropy over masked positions
    loss_sum: torch.Tensor      # summed cross-entropy (for exact averaging across micro-batches and ranks)
    num_masked: torch.Tensor
    num_correct: torch.Tensor


class MLMHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.transformer_dim, cfg.embedding_dim)
        self.norm = nn.LayerNorm(cfg.embedding_dim, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.act = activation(cfg)

    def reset_bias(self, scheme: str) -> None:
        """The decoder's bias: zero ("bert"), or as the authors' nn.Linear decoder had it ("paper": uniform in
        ±1/sqrt(embedding_dim), PyTorch's default)."""
        if scheme == "paper":
            bound = 1 / math.sqrt(self.dense.out_features)  # the decoder's fan-in: embedding_dim
            nn.init.uniform_(self.bias, -bound, bound)
        else:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, decoder_weight: torch.Tensor) -> torch.Tensor:
        # The decoder is tied to the word embeddings, passed in rather than registered twice.
        x = self.norm(self.act(self.dense(x)))
        return F.linear(x, decoder_weight, self.bias)


class NystromformerForMaskedLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.mlm_head = MLMHead(cfg)
        init_weights(self, cfg.weight_init)
        self.mlm_head.reset_bias(cfg.weight_init)

    def logits(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        """Vocabulary logits at every position (for inspection and fill-mask)."""
        hidden = self.encoder(input_ids, attention_mask, token_type_ids)
        return self.mlm_head(hidden, self.encoder.embeddings.word_embeddings.weight)

    def forward(self, input_ids, labels, attention_mask=None, token_type_ids=None,
                masked_positions=None) -> MLMOutput:
        """``masked_positions``: the flat indices (into ``labels.view(-1)``) of the labelled positions, if the caller
        has them: found on the host before the batch is copied, they spare a device sync (``labels != -100`` has
        a data-dependent size) in the middle of the step."""
        hidden = self.encoder(input_ids, attention_mask, token_type_ids)
        if masked_positions is None:
            masked_positions = masked_positions_of(labels)
        # Only masked positions go through the vocabulary projection: ~15% of the work and memory.
        targets = labels.reshape(-1).index_select(0, masked_positions)
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, masked_positions)
        logits = self.mlm_head(selected, self.encoder.embeddings.word_embeddings.weight).float()
        loss_sum = F.cross_entropy(logits, targets, reduction="sum")
        num_masked = targets.numel()
        num_correct = (logits.argmax(dim=-1) == targets).sum()
        return MLMOutput(loss=loss_sum / max(num_masked, 1), loss_sum=loss_sum,
                         num_masked=torch.full((), num_masked, device=input_ids.device), num_correct=num_correct)


def masked_positions_of(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of the positions with a label (row-major order, as boolean indexing selects them)."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


class ClassificationHead(nn.Module):
    """First-token head (as transformers' Nyströmformer): dropout → dense → GELU → dropout → projection."""

    def __init__(self, cfg: ModelConfig, num_labels: int):
        super().__init__()
        self.dropout = nn.Dropout(cfg.dropout_prob)
        self.dense = nn.Linear(cfg.transformer_dim, cfg.transformer_dim)
        self.out_proj = nn.Linear(cfg.transformer_dim, num_labels)
        self.act = activation(cfg)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.dropout(hidden[:, 0])
        x = self.dropout(self.act(self.dense(x)))
        return self.out_proj(x)


class NystromformerForSequenceClassification(nn.Module):
    """Classification (num_labels ≥ 2, cross-entropy) or regression (num_labels = 1, MSE) on the first token."""

    def __init__(self, cfg: ModelConfig, num_labels: int):
        super().__init__()
        self.config = cfg
        self.num_labels = num_labels
        self.encoder = Encoder(cfg)
        self.classifier = ClassificationHead(cfg, num_labels)
        init_weights(self, cfg.weight_init)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        logits = self.classifier(self.encoder(input_ids, attention_mask, token_type_ids))
        return logits.squeeze(-1) if self.num_labels == 1 else logits

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.num_labels == 1:
            return F.mse_loss(logits.float(), labels.float())
        return F.cross_entropy(logits.float(), labels)
