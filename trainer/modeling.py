"""Temporal Fusion Transformer (Lim et al. 2021) for quantile forecasts of futures returns.

Shapes: B batch, L encoder length, H horizon, T = L + H, V variables, D hidden_size, E per-variable embedding size
(cfg.var_hidden), Q quantiles, nh heads, hs head size.

The model takes raw features and returns quantiles in return units: the normalisation and the target scale are buffers
inside it, so they travel into ONNX. No control flow depends on data, and the batch dimension may be dynamic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from features.config import BUILTIN_OBSERVED
from trainer.model_config import CALENDAR_COLUMNS, ModelConfig

T = TypeVar("T")
Array = Tensor | np.ndarray
Statics = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # c_selection, c_enrichment, c_h, c_c [B, D]; static weights
LOG_RETURN = BUILTIN_OBSERVED.index("log_return")  # the observed feature the volatility scale reads
LOG_RANGE = BUILTIN_OBSERVED.index("log_range")  # log(high / low), which a seasonal scale reads too
VOL_INPUTS = [LOG_RETURN, LOG_RANGE]  # the observed columns the volatility scale reads
RANGE_VARIANCE = 1.0 / (4.0 * math.log(2.0))  # Parkinson: E[log(high/low)^2] = 4 ln 2 sigma^2 for a random walk
VOL_DECAY = 0.94  # the volatility scale's starting weight decay per bar (RiskMetrics'); trained with the model
# a seasonal scale forecasts each future bar's variance as GARCH(1,1) does, between the encoder's EWMA and the
# symbol's long-run level; both weights are trained with the model
VOL_MIX = 0.7  # the EWMA's starting share of the next bar's variance, the long-run level's the rest
VOL_PERSIST = 0.98  # the starting persistence per bar of the variance's distance from the long-run level
RANGE_MIX = 0.5  # the range's starting share of each encoder bar's variance (Parkinson's; the return's the rest)
SCALE_LR_FACTOR = 100.0  # the seasonal scale's scalars learn this many times faster than the network, no decay
TOD_HARMONICS = 6  # harmonics of the time of day in the seasonal volatility profile
DOW_HARMONICS = 2  # harmonics of the day of week (its 7 values hold 3)
CROSS_HARMONICS = 2  # time-of-day harmonics 1..this, each times the day of week's first harmonic
N_TOD_TERMS = 2 * TOD_HARMONICS
N_PROFILE_TERMS = N_TOD_TERMS + 2 * DOW_HARMONICS + 4 * CROSS_HARMONICS  # the profile's terms, the constant aside
C = TypeVar("C", Tensor, np.ndarray)


class TFTOutput(NamedTuple):
    """Field names equal features.schema.MODEL_OUTPUTS, in that order."""

    quantiles: Tensor  # [B, H, Q] cumulative log-return quantiles, non-crossing
    attention: Tensor  # [B, H, L+H] decoder rows, mean over heads
    static_weights: Tensor  # [B, n_static_vars]: categoricals, then reals
    encoder_weights: Tensor  # [B, L, n_observed + n_known]
    decoder_weights: Tensor  # [B, H, n_known]


class Dropout(nn.Module):
    """Inverted dropout (as nn.Dropout); on the CPU its mask is one uniform draw compared in place, 1.7x
    faster than torch's bernoulli_ mask. Identity in eval mode, and so in the exported graph."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, training=True)
        keep = torch.empty_like(x).uniform_().ge_(self.p).mul_(1.0 / (1.0 - self.p))  # 0 or 1/(1-p), like x
        return x * keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class GLU(nn.Module):
    """Gated linear unit: a * sigmoid(b) with [a, b] = Linear(x)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_size, 2 * output_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.glu(self.proj(x), dim=-1)  # [..., out]


class GatedResidualNetwork(nn.Module):
    """LayerNorm(skip(a) + GLU(dropout(W2 ELU(W1 a + Wc c))))."""

    def __init__(self, input_size: int, hidden_size: int, output_size: int, dropout: float,
                 context_size: int = 0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.context = nn.Linear(context_size, hidden_size, bias=False) if context_size else None
        self.fc2 = nn.Linear(hidden_size, hidden_size)
        self.dropout = Dropout(dropout)
        self.gate = GLU(hidden_size, output_size)
        self.skip = nn.Linear(input_size, output_size) if input_size != output_size else None
        self.norm = nn.LayerNorm(output_size)

    def forward(self, a: Tensor, c: Tensor | None = None) -> Tensor:
        # a: [..., in]; c: [..., ctx] broadcastable against a's leading dims (e.g. [B, 1, ctx])
        x = self.fc1(a)  # [..., hidden]
        if self.context is not None and c is not None:
            x = x + self.context(c)  # [..., hidden]
        x = self.dropout(self.fc2(F.elu(x)))  # [..., hidden]
        residual = self.skip(a) if self.skip is not None else a  # [..., out]
        return self.norm(residual + self.gate(x))  # [..., out]


class GateAddNorm(nn.Module):
    """LayerNorm(skip + GLU(dropout(x))): the gated skip connection around a block."""

    def __init__(self, size: int, dropout: float) -> None:
        super().__init__()
        self.dropout = Dropout(dropout)
        self.gate = GLU(size, size)
        self.norm = nn.LayerNorm(size)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        return self.norm(skip + self.gate(self.dropout(x)))  # [..., D]


class BatchedLinear(nn.Module):
    """One independent Linear per variable: weights [V, in, out], applied as one matmul."""

    def __init__(self, n_vars: int, input_size: int, output_size: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(input_size)  # same init as nn.Linear
        self.weight = nn.Parameter(torch.empty(n_vars, input_size, output_size).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n_vars, 1, output_size).uniform_(-bound, bound))

    def forward(self, x: Tensor) -> Tensor:
        return torch.baddbmm(self.bias, x, self.weight)  # [V, N, in] @ [V, in, out] + [V, 1, out] -> [V, N, out]


class VariableGRNs(nn.Module):
    """V separate GRNs (E -> D, no context) evaluated together, variable dimension leading; inner width
    min(E, D), so with E = D this is the paper's GRN of width d_model."""

    def __init__(self, n_vars: int, input_size: int, hidden_size: int, dropout: float) -> None:
        super().__init__()
        inner = min(input_size, hidden_size)
        self.fc1 = BatchedLinear(n_vars, input_size, inner)
        self.fc2 = BatchedLinear(n_vars, inner, inner)
        self.dropout = Dropout(dropout)
        self.gate = BatchedLinear(n_vars, inner, 2 * hidden_size)  # GLU projection
        self.skip = BatchedLinear(n_vars, input_size, hidden_size) if input_size != hidden_size else None
        self.norm_weight = nn.Parameter(torch.ones(n_vars, 1, hidden_size))  # per-variable LayerNorm
        self.norm_bias = nn.Parameter(torch.zeros(n_vars, 1, hidden_size))
        self.hidden_size = hidden_size

    def forward(self, x: Tensor) -> Tensor:
        x = x.transpose(0, 1)  # [N, V, E] -> [V, N, E]
        residual = self.skip(x) if self.skip is not None else x  # [V, N, D]
        h = self.dropout(self.fc2(F.elu(self.fc1(x))))  # [V, N, E]
        h = F.glu(self.gate(h), dim=-1)  # [V, N, D]
        y = F.layer_norm(residual + h, (self.hidden_size,)) * self.norm_weight + self.norm_bias  # [V, N, D]
        return y.transpose(0, 1)  # [N, V, D]


class RealEmbedding(nn.Module):
    """Each real variable v becomes x_v * W[v] + b[v], a vector of size E."""

    def __init__(self, n_vars: int, size: int) -> None:
        super().__init__()
        self.n_vars = n_vars
        self.weight = nn.Parameter(torch.empty(n_vars, size).uniform_(-1.0, 1.0))  # like nn.Linear(1, E)
        self.bias = nn.Parameter(torch.empty(n_vars, size).uniform_(-1.0, 1.0))

    def forward(self, x: Tensor) -> Tensor:
        return x.unsqueeze(-1) * self.weight + self.bias  # [..., V] -> [..., V, E]


class CategoricalEmbedding(nn.Module):
    """One nn.Embedding per categorical variable, stacked along a variable dimension. Id 0 of a user categorical is its
    unknown slot, which no training label reaches: a fixed zero vector (`padding_idx`), so an unseen label enters as a
    neutral input, not as an untrained random one. The first `without_slot` variables (the symbol) have no such slot."""

    def __init__(self, cardinalities: tuple[int, ...], size: int, without_slot: int = 0) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(n, size, padding_idx=None if i < without_slot else 0)
                                        for i, n in enumerate(cardinalities))

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [..., V] int64 (or float32 holding exact integers: the time-varying inputs)
        ids = ids.long()
        return torch.stack([emb(ids[..., i]) for i, emb in enumerate(self.embeddings)], dim=-2)  # [..., V, E]


class VariableSelectionNetwork(nn.Module):
    """Softmax weights over variables from all embeddings (+ context), times each variable's GRN."""

    def __init__(self, n_vars: int, input_size: int, hidden_size: int, dropout: float, context_size: int = 0):
        super().__init__()
        self.n_vars, self.input_size, self.hidden_size = n_vars, input_size, hidden_size
        self.flat_grn = GatedResidualNetwork(n_vars * input_size, hidden_size, n_vars, dropout, context_size)
        self.var_grns = VariableGRNs(n_vars, input_size, hidden_size, dropout)

    def forward(self, emb: Tensor, c: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # emb: [..., V, E] (leading dims [B] or [B, T]); c: broadcastable to [..., ctx]
        weights = torch.softmax(self.flat_grn(emb.flatten(-2), c), dim=-1)  # [..., V]
        per_var = self.var_grns(emb.reshape(-1, self.n_vars, self.input_size))  # [N, V, D]
        per_var = per_var.reshape((*emb.shape[:-1], self.hidden_size))  # [..., V, D]
        out = (per_var * weights.unsqueeze(-1)).sum(dim=-2)  # [..., V, D] weighted by [..., V, 1] -> [..., D]
        return out, weights


class StaticCovariateEncoder(nn.Module):
    """Static VSN over the categoricals then the reals; four GRNs give the selection, enrichment, h0 and c0 contexts."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.embedding = CategoricalEmbedding(cfg.static_cardinalities, cfg.var_hidden, without_slot=1)  # the symbol
        self.real_embedding = RealEmbedding(cfg.n_static_real, cfg.var_hidden) if cfg.n_static_real else None
        self.vsn = VariableSelectionNetwork(cfg.n_static_vars, cfg.var_hidden, d, cfg.dropout)
        self.contexts = nn.ModuleList(GatedResidualNetwork(d, d, d, cfg.dropout) for _ in range(4))

    def forward(self, s: Tensor, reals: Tensor | None = None) -> Statics:
        # s: [B, n_static] int64; reals: [B, n_static_real] normalised
        emb = self.embedding(s)  # [B, n_static, E]
        if self.real_embedding is not None and reals is not None:
            emb = torch.cat([emb, self.real_embedding(reals)], dim=1)  # [B, n_static_vars, E]
        x, weights = self.vsn(emb)  # [B, D], [B, n_static_vars]
        c_selection, c_enrichment, c_h, c_c = (grn(x) for grn in self.contexts)  # 4 x [B, D]
        return c_selection, c_enrichment, c_h, c_c, weights


class InterpretableMultiHeadAttention(nn.Module):
    """Per-head Q and K, one V shared by all heads, heads averaged (so weights are interpretable)."""

    future_mask: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, self.nh, self.hs = cfg.hidden_size, cfg.attention_heads, cfg.hidden_size // cfg.attention_heads
        self.L, self.H, self.T = cfg.encoder_length, cfg.horizon, cfg.encoder_length + cfg.horizon
        self.q = nn.Linear(d, self.nh * self.hs)
        self.k = nn.Linear(d, self.nh * self.hs)
        self.v = nn.Linear(d, self.hs)  # shared by all heads
        self.out = nn.Linear(self.hs, d)
        self.dropout = Dropout(cfg.dropout)
        # decoder query i sits at absolute position L + i and may see keys j <= L + i: [1, T] > [H, 1]
        future = torch.arange(self.T)[None, :] > torch.arange(self.L, self.T)[:, None]  # [H, T] True = masked
        self.register_buffer("future_mask", future, persistent=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        # x: [B, T, D]; queries are the decoder positions only
        q = self.q(x[:, self.L :]).view(-1, self.H, self.nh, self.hs).transpose(1, 2)  # [B, nh, H, hs]
        k = self.k(x).view(-1, self.T, self.nh, self.hs).transpose(1, 2)  # [B, nh, T, hs]
        v = self.v(x).unsqueeze(1)  # [B, 1, T, hs]
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.hs)  # [B, nh, H, T]
        scores = scores.masked_fill(self.future_mask, float("-inf"))  # [B, nh, H, T]
        attn = torch.softmax(scores, dim=-1)  # [B, nh, H, T]
        heads = torch.matmul(self.dropout(attn), v)  # [B, nh, H, hs]
        return self.out(heads.mean(dim=1)), attn.mean(dim=1)  # [B, H, D], [B, H, T]


class AttentionBlock(nn.Module):
    """Self-attention over the enriched sequence, then the gated skip to the decoder positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.L = cfg.encoder_length
        self.attention = InterpretableMultiHeadAttention(cfg)
        self.gate = GateAddNorm(cfg.hidden_size, cfg.dropout)

    def forward(self, enriched: Tensor) -> tuple[Tensor, Tensor]:
        x, attn = self.attention(enriched)  # [B, H, D], [B, H, T]
        return self.gate(x, enriched[:, self.L :]), attn  # [B, H, D], [B, H, T]


class QuantileHead(nn.Module):
    """Linear to Q raw values, made non-crossing: q_0 = p_0 + r_0, q_i = q_{i-1} + softplus(r_i + b_i), where
    softplus(b_i) = p_i - p_{i-1}. With a `prior` (increasing [Q]) the projection starts near zero (no bias,
    weights 1/100 of nn.Linear's), so the head starts by returning about the prior; without one, p = b = 0."""

    prior: Tensor
    step_bias: Tensor

    def __init__(self, hidden_size: int, n_quantiles: int, prior: Tensor | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, n_quantiles)
        gaps = torch.zeros(n_quantiles - 1) if prior is None else prior[1:] - prior[:-1]
        self.register_buffer("prior", torch.zeros(1) if prior is None else prior[:1].clone(), persistent=False)
        self.register_buffer("step_bias", gaps + torch.log(-torch.expm1(-gaps)) if prior is not None else gaps,
                             persistent=False)  # softplus^-1(gaps)
        if prior is not None:
            with torch.no_grad():
                self.proj.weight.mul_(0.01)
                self.proj.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        raw = self.proj(x)  # [B, H, Q]
        steps = torch.cat([raw[..., :1] + self.prior, F.softplus(raw[..., 1:] + self.step_bias)], dim=-1)  # [B, H, Q]
        return torch.cumsum(steps, dim=-1)  # [B, H, Q]


class TemporalFusionTransformer(nn.Module):
    observed_mean: Tensor  # buffers, declared for type checkers
    observed_std: Tensor
    known_mean: Tensor
    known_std: Tensor
    static_mean: Tensor
    static_std: Tensor
    target_scale: Tensor
    horizon_root: Tensor
    bar_age: Tensor
    profile_coef: Tensor
    profile_bounds: Tensor
    profile_level: Tensor
    profile_ranged: Tensor
    future_age: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, e, p = cfg.hidden_size, cfg.var_hidden, cfg.dropout
        self.gradient_checkpointing: bool = False  # recompute big blocks in backward (training only)
        # normalisation folded into the model: raw features in, return units out
        self.register_buffer("observed_mean", torch.zeros(cfg.n_observed))
        self.register_buffer("observed_std", torch.ones(cfg.n_observed))
        self.register_buffer("known_mean", torch.zeros(cfg.n_known))
        self.register_buffer("known_std", torch.ones(cfg.n_known))
        self.register_buffer("target_scale", torch.ones(cfg.horizon))
        if cfg.n_static_real:
            self.register_buffer("static_mean", torch.zeros(cfg.n_static_real))
            self.register_buffer("static_std", torch.ones(cfg.n_static_real))
        # variable selection
        self.static_encoder = StaticCovariateEncoder(cfg)
        self.observed_embedding = RealEmbedding(cfg.n_observed_real, e)
        self.known_embedding = RealEmbedding(cfg.n_known_real, e)  # shared by encoder and decoder
        # categoricals' embeddings, shared by encoder and decoder; None without them (state as before)
        self.observed_categorical = CategoricalEmbedding(cfg.observed_cardinalities, e) \
            if cfg.observed_cardinalities else None
        self.known_categorical = CategoricalEmbedding(cfg.known_cardinalities, e) if cfg.known_cardinalities else None
        self.encoder_vsn = VariableSelectionNetwork(cfg.n_encoder_vars, e, d, p, context_size=d)
        self.decoder_vsn = VariableSelectionNetwork(cfg.n_known, e, d, p, context_size=d)
        lstm_dropout = p if cfg.lstm_layers > 1 else 0.0
        self.encoder_lstm = nn.LSTM(d, d, cfg.lstm_layers, batch_first=True, dropout=lstm_dropout)
        self.decoder_lstm = nn.LSTM(d, d, cfg.lstm_layers, batch_first=True, dropout=lstm_dropout)
        self.lstm_gate = GateAddNorm(d, p)
        # temporal fusion decoder
        self.enrichment = GatedResidualNetwork(d, d, d, p, context_size=d)
        self.attention_block = AttentionBlock(cfg)
        self.positionwise_grn = GatedResidualNetwork(d, d, d, p)
        self.output_gate = GateAddNorm(d, 0.0)  # no dropout this late, as in the paper's code and pytorch-forecasting
        # quantile_scale "volatility": the head starts from the Gaussian forecast of the encoder's volatility
        volatility = cfg.quantile_scale == "volatility"
        gaussian = torch.special.ndtri(torch.tensor(cfg.quantiles, dtype=torch.float64)).float()  # [Q] N(0,1)'s
        self.head = QuantileHead(d, cfg.n_quantiles, gaussian if volatility else None)
        self.register_buffer("horizon_root", torch.arange(1, cfg.horizon + 1).float().sqrt(), persistent=False)
        self.register_buffer("bar_age", torch.arange(cfg.encoder_length - 1, -1, -1).float(), persistent=False)  # [L]
        if volatility:
            self.vol_decay_logit = nn.Parameter(torch.tensor(math.log(VOL_DECAY / (1.0 - VOL_DECAY))))
        if cfg.seasonal_scale:  # one profile per symbol, fitted with the normalisation (set_profile); zeros: flat
            n_symbols = cfg.static_cardinalities[0]
            self.register_buffer("profile_coef", torch.zeros(n_symbols, 1 + N_PROFILE_TERMS))  # [S, 1 + P]
            self.register_buffer("profile_bounds", torch.zeros(n_symbols, 2))  # [S, 2] least and most log profile
            self.register_buffer("profile_level", torch.zeros(n_symbols))  # [S] long-run RMS return; 0: none
            self.register_buffer("profile_ranged", torch.zeros(n_symbols))  # [S] 1: the bars' ranges count
            self.register_buffer("future_age", torch.arange(cfg.horizon).float(), persistent=False)  # [H]
            self.vol_mix_logit = nn.Parameter(torch.tensor(math.log(VOL_MIX / (1.0 - VOL_MIX))))
            self.vol_persist_logit = nn.Parameter(torch.tensor(math.log(VOL_PERSIST / (1.0 - VOL_PERSIST))))
            self.range_mix_logit = nn.Parameter(torch.tensor(math.log(RANGE_MIX / (1.0 - RANGE_MIX))))

    def set_normalization(self, observed_mean: Array, observed_std: Array, known_mean: Array, known_std: Array,
                          target_scale: Array, static_mean: Array | None = None,
                          static_std: Array | None = None) -> None:
        """Copy fitted statistics into the buffers; stds and scales must be finite and > 0. Entries of categorical
        columns are stored but not used (ids are never normalised)."""
        values = {"observed_mean": observed_mean, "observed_std": observed_std, "known_mean": known_mean,
                  "known_std": known_std, "target_scale": target_scale}
        if self.cfg.n_static_real:
            if static_mean is None or static_std is None:
                raise ValueError("static_mean and static_std are needed: the model has static reals")
            values |= {"static_mean": static_mean, "static_std": static_std}
        for name, value in values.items():
            buf: Tensor = getattr(self, name)
            t = torch.as_tensor(value).detach().to(dtype=buf.dtype, device=buf.device)
            if t.shape != buf.shape:
                raise ValueError(f"{name}: expected shape {tuple(buf.shape)}, got {tuple(t.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: contains NaN or inf")
            if not name.endswith("_mean") and not bool((t > 0).all()):
                raise ValueError(f"{name}: every entry must be > 0, got {t.tolist()}")
            with torch.no_grad():
                buf.copy_(t)

    def set_profile(self, coefficients: Array, bounds: Array, level: Array, ranged: Array) -> None:
        """Copy fitted log-volatility profiles (trainer.data.training_profile), a row per symbol id, to the buffers."""
        with torch.no_grad():
            for buf, value in ((self.profile_coef, coefficients), (self.profile_bounds, bounds),
                               (self.profile_level, level), (self.profile_ranged, ranged)):
                buf.copy_(torch.as_tensor(value))

    def scale_parameters(self) -> list[nn.Parameter]:
        """The seasonal scale's few trained scalars (its EWMA decay, mix, persistence and range share): each moves
        every forecast at once, so the trainer gives them a learning rate of their own (SCALE_LR_FACTOR)."""
        if not self.cfg.seasonal_scale:
            return []
        return [self.vol_decay_logit, self.vol_mix_logit, self.vol_persist_logit, self.range_mix_logit]

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args), recomputed in backward instead of stored when checkpointing a training step."""
        if self.gradient_checkpointing and self.training:
            return cast(T, checkpoint(fn, *args, use_reentrant=False))
        return fn(*args)

    def _select_encoder(self, observed: Tensor, known: Tensor, c_selection: Tensor) -> tuple[Tensor, Tensor]:
        # observed [..., n_obs], known [..., n_known]; c_selection broadcastable to [..., D]
        emb = torch.cat([_embed(observed, self.observed_embedding, self.observed_categorical),
                         _embed(known, self.known_embedding, self.known_categorical)], dim=-2)  # [..., V, E]
        return self.encoder_vsn(emb, c_selection)  # [..., D], [..., V]

    def _select_decoder(self, known: Tensor, c_selection: Tensor) -> tuple[Tensor, Tensor]:
        emb = _embed(known, self.known_embedding, self.known_categorical)  # [B, H, n_known, E]
        return self.decoder_vsn(emb, c_selection.unsqueeze(1))  # [B, H, D], [B, H, n_known]

    def _lstm_stage(self, enc_x: Tensor, dec_x: Tensor, c_h: Tensor, c_c: Tensor) -> Tensor:
        n = self.cfg.lstm_layers
        h0 = c_h.unsqueeze(0).repeat(n, 1, 1)  # [layers, B, D]
        c0 = c_c.unsqueeze(0).repeat(n, 1, 1)  # [layers, B, D]
        enc_out, (h_n, c_n) = self.encoder_lstm(enc_x, (h0, c0))  # [B, L, D], 2 x [layers, B, D]
        # a no-op reshape, except under torch 2.11's export, which traces the final state as 4-D
        state = (h_n.reshape(n, -1, self.cfg.hidden_size), c_n.reshape(n, -1, self.cfg.hidden_size))
        dec_out, _ = self.decoder_lstm(dec_x, state)  # [B, H, D]
        lstm_out = torch.cat([enc_out, dec_out], dim=1)  # [B, T, D]
        selected = torch.cat([enc_x, dec_x], dim=1)  # [B, T, D]
        return self.lstm_gate(lstm_out, selected)  # [B, T, D]

    def _normalize(self, observed: Tensor, known: Tensor) -> tuple[Tensor, Tensor]:
        return (_standardize(observed, self.observed_mean, self.observed_std, self.cfg.n_observed_real),
                _standardize(known, self.known_mean, self.known_std, self.cfg.n_known_real))

    def _statics(self, static_categorical: Tensor, static_real: Tensor | None) -> Statics:
        # static_categorical [B, n_static] int64; static_real [B, n_static_real] raw, when the model has them
        reals = (static_real - self.static_mean) / self.static_std if static_real is not None else None
        return self._run(self.static_encoder, static_categorical, reals)  # 4 x [B, D], [B, n_static_vars]

    def forward(self, static_categorical: Tensor, encoder_observed: Tensor, encoder_known: Tensor,
                decoder_known: Tensor, static_real: Tensor | None = None) -> TFTOutput:
        # static_categorical [B, n_static] int64; encoder_observed [B, L, n_obs]; encoder_known [B, L, n_known];
        # decoder_known [B, H, n_known]; static_real [B, n_static_real] (when cfg.n_static_real); all raw, with
        # categorical columns as ids
        observed, enc_known = self._normalize(encoder_observed, encoder_known)  # [B, L, n_obs], [B, L, n_known]
        statics = self._statics(static_categorical, static_real)  # 4 x [B, D], [B, n_static_vars]
        c_sel = statics[0].unsqueeze(1)  # [B, 1, D]
        enc_x, enc_w = self._run(self._select_encoder, observed, enc_known, c_sel)  # [B, L, D], [B, L, V]
        calendar = encoder_known[..., :CALENDAR_COLUMNS] if self.cfg.seasonal_scale else None  # [B, L, 4]
        return self._decode(statics, enc_x, enc_w, decoder_known, encoder_observed[..., VOL_INPUTS], calendar,
                            static_categorical[:, 0])

    def forward_rows(self, static_categorical: Tensor, row_observed: Tensor, row_known: Tensor, row_window: Tensor,
                     window_rows: Tensor, decoder_known: Tensor, static_real: Tensor | None = None) -> TFTOutput:
        """The forward of overlapping windows, each distinct bar's encoder variable selection run once. Window b's
        encoder step l is bar row window_rows[b, l]; bar r takes its static context from window row_window[r]. In eval
        mode this equals `forward` on the gathered windows; in training, dropout masks are drawn per bar, not window."""
        # static_categorical [B, n_static]; row_observed [R, n_obs]; row_known [R, n_known]; row_window [R];
        # window_rows [B, L] int64 in [0, R); decoder_known [B, H, n_known]
        observed, known = self._normalize(row_observed, row_known)  # [R, n_obs], [R, n_known]
        statics = self._statics(static_categorical, static_real)  # 4 x [B, D], [B, n_static_vars]
        row_x, row_w = self._run(self._select_rows, observed, known, statics[0], row_window)  # [R, D], [R, V]
        # index_select, not row_x[window_rows]: on the CPU its backward (index_add_) sums shared bars in a
        # fixed order, so runs repeat exactly
        b, length = window_rows.shape
        enc_x = row_x.index_select(0, window_rows.flatten()).view(b, length, row_x.shape[-1])  # [B, L, D]
        enc_w = row_w.index_select(0, window_rows.flatten()).view(b, length, row_w.shape[-1])  # [B, L, V]
        vol_inputs = row_observed[:, VOL_INPUTS].index_select(0, window_rows.flatten()).view(b, length, 2)
        calendar = (row_known[:, :CALENDAR_COLUMNS].index_select(0, window_rows.flatten()).view(b, length, -1)
                    if self.cfg.seasonal_scale else None)  # [B, L, 4]
        return self._decode(statics, enc_x, enc_w, decoder_known, vol_inputs, calendar, static_categorical[:, 0])

    def _select_rows(self, observed: Tensor, known: Tensor, c_selection: Tensor, row_window: Tensor
                     ) -> tuple[Tensor, Tensor]:
        # observed [R, n_obs], known [R, n_known], c_selection [B, D], row_window [R]: each row's context
        return self._select_encoder(observed, known, c_selection[row_window])  # [R, D], [R, V]

    def _decode(self, statics: Statics, enc_x: Tensor, enc_w: Tensor, decoder_known: Tensor,
                vol_inputs: Tensor, encoder_calendar: Tensor | None, symbol: Tensor) -> TFTOutput:
        # enc_x [B, L, D] and enc_w [B, L, V] from encoder variable selection; decoder_known raw [B, H, n_known];
        # vol_inputs [B, L, 2] raw 1-bar log returns and log ranges of the encoder bars (VOL_INPUTS); symbol [B] ids;
        # encoder_calendar [B, L, 4] raw calendar features of the encoder bars (a seasonal scale's), else None
        L = self.cfg.encoder_length
        c_sel, c_enr, c_h, c_c, static_w = statics  # 4 x [B, D], [B, n_static]
        dec_known = _standardize(decoder_known, self.known_mean, self.known_std, self.cfg.n_known_real)
        dec_x, dec_w = self._run(self._select_decoder, dec_known, c_sel)  # [B, H, D], [B, H, n_known]
        temporal = self._run(self._lstm_stage, enc_x, dec_x, c_h, c_c)  # [B, T, D]

        enriched = self._run(self.enrichment, temporal, c_enr.unsqueeze(1))  # [B, T, D]
        x, attn = self._run(self.attention_block, enriched)  # [B, H, D], [B, H, T]
        x = self._run(self.positionwise_grn, x)  # [B, H, D]
        x = self.output_gate(x, temporal[:, L:])  # [B, H, D]
        if encoder_calendar is None:
            scale = self._scale(vol_inputs[..., 0])  # [B or 1, H, 1]
        else:
            scale = self._seasonal_scale(vol_inputs, encoder_calendar, decoder_known[..., :CALENDAR_COLUMNS], symbol)
        quantiles = self.head(x) * scale  # [B, H, Q] in return units
        return TFTOutput(quantiles, attn, static_w, enc_w, dec_w)

    def forecast_scale(self, encoder_observed: Tensor, encoder_known: Tensor | None = None,
                       decoder_known: Tensor | None = None, static_categorical: Tensor | None = None) -> Tensor:
        """The unit the quantiles are forecast in, of windows with these raw inputs (encoder_observed
        [B, L, n_obs]; encoder_known [B, L, n_known], decoder_known [B, H, n_known] and static_categorical
        [B, n_static], which a seasonal scale needs): [B or 1, H, 1]."""
        if not self.cfg.seasonal_scale:
            return self._scale(encoder_observed[..., LOG_RETURN])
        if encoder_known is None or decoder_known is None or static_categorical is None:
            raise ValueError("a seasonal scale needs the windows' encoder_known, decoder_known and static_categorical")
        return self._seasonal_scale(encoder_observed[..., VOL_INPUTS], encoder_known[..., :CALENDAR_COLUMNS],
                                    decoder_known[..., :CALENDAR_COLUMNS], static_categorical[:, 0])

    def _scale(self, encoder_returns: Tensor) -> Tensor:
        """The unit of the head's output: [B or 1, H, 1]. "volatility": the exponentially weighted RMS of the 1-bar
        returns encoder_returns [B, L] (_ewma_rms, its decay per bar learnt, from VOL_DECAY) times sqrt(h); "fixed":
        each horizon's training target spread."""
        if self.cfg.quantile_scale == "fixed":
            return self.target_scale[None, :, None]  # [1, H, 1]
        volatility = self._ewma_rms(encoder_returns.float().square())  # [B]
        return volatility[:, None, None] * self.horizon_root[None, :, None]  # [B, H, 1]

    def _ewma_rms(self, bar_variance: Tensor) -> Tensor:
        """The root of the exponentially weighted mean of bar_variance [B, L], >= 1% of the returns' spread: [B]."""
        weights = torch.sigmoid(self.vol_decay_logit) ** self.bar_age  # [L], the last bar's 1
        rms = (bar_variance * (weights / weights.sum())).sum(dim=1).sqrt()  # [B]
        return torch.maximum(rms, 0.01 * self.target_scale[:1])  # [B]; Max, which fp16 graphs run in half

    def _seasonal_scale(self, vol_inputs: Tensor, encoder_calendar: Tensor, decoder_calendar: Tensor,
                        symbol: Tensor) -> Tensor:
        """The volatility scale of deseasonalised bars, as a seasonal GARCH forecasts it: sqrt(sum_{j<=h}
        p_j^2 v_j) with p_j the symbol's time-of-day profile at future bar j and v_j = level^2 + m phi^(j-1)
        (sigma^2 - level^2); sigma^2 the EWMA over the encoder bars of their variance / p^2, each bar's variance
        a learnt mix of its squared return and its range's (Parkinson's estimator, several times as efficient
        where bars trade throughout); [B, H, 1]. A flat profile, no level and no range give the plain scale."""
        # vol_inputs [B, L, 2] returns and log ranges; encoder_calendar [B, L, 4], decoder_calendar [B, H, 4] raw
        # calendar features; symbol [B] int64
        coef, bounds = self.profile_coef[symbol], self.profile_bounds[symbol]  # [B, 1 + P], [B, 2]
        mix = torch.sigmoid(self.range_mix_logit) * self.profile_ranged[symbol][:, None]  # [B, 1]
        bar_var = (1.0 - mix) * vol_inputs[..., 0].float().square() \
            + mix * RANGE_VARIANCE * vol_inputs[..., 1].float().square()  # [B, L]
        length = encoder_calendar.shape[1]
        log_p = _log_profile(torch.cat([encoder_calendar, decoder_calendar], dim=1), coef, bounds)  # [B, L + H]
        plain = bar_var * torch.exp(-2.0 * log_p[:, :length])  # [B, L]
        recent = self._ewma_rms(plain).square()  # [B]
        level = self.profile_level[symbol].square()  # [B]
        level = torch.where(level > 0, level, recent)  # [B]
        weight = torch.sigmoid(self.vol_mix_logit) * torch.sigmoid(self.vol_persist_logit) ** self.future_age  # [H]
        variance = level[:, None] + weight * (recent - level)[:, None]  # [B, H] of each future bar
        profile = torch.exp(2.0 * log_p[:, length:])  # [B, H]
        return (profile * variance).cumsum(dim=1).sqrt()[..., None]  # [B, H, 1]


def _log_profile(calendar: Tensor, coef: Tensor, bounds: Tensor) -> Tensor:
    """log p [B, T] at raw calendar features [B, T, 4] by each window's coefficients [B, 1 + P], in bounds [B, 2]."""
    terms = torch.stack(profile_terms(*calendar.float().unbind(-1)), dim=-1)  # [B, T, P]
    log_p = (terms @ coef[:, 1:, None])[..., 0] + coef[:, :1]  # [B, T]
    return torch.minimum(torch.maximum(log_p, bounds[:, :1]), bounds[:, 1:])  # [B, T]


def harmonics(sin: C, cos: C, k: int) -> list[tuple[C, C]]:
    """(sin j*a, cos j*a) for j = 1..k from sin a and cos a, by the Chebyshev recursion: no angle (atan2) needed."""
    out = [(sin, cos)]
    before: tuple[C | float, C | float] = (0.0, 1.0)  # j = 0
    for _ in range(k - 1):
        s, c = out[-1]
        out.append((2.0 * cos * s - before[0], 2.0 * cos * c - before[1]))
        before = (s, c)
    return out


def profile_terms(tod_sin: C, tod_cos: C, dow_sin: C, dow_cos: C) -> list[C]:
    """The terms of the log-volatility profile at calendar features (features.calendar.known_features), the
    constant aside: N_TOD_TERMS of the time of day first, then the day of week's, then the products of the
    low time-of-day harmonics with the day of week's first. numpy arrays and tensors alike."""
    tod = harmonics(tod_sin, tod_cos, TOD_HARMONICS)
    dow = harmonics(dow_sin, dow_cos, DOW_HARMONICS)
    cross = [a * b for pair in tod[:CROSS_HARMONICS] for a in pair for b in dow[0]]
    return [x for pair in tod + dow for x in pair] + cross


def _embed(x: Tensor, reals: RealEmbedding, categorical: CategoricalEmbedding | None) -> Tensor:
    """x [..., V]: normalised reals, then raw ids (one per embedding of `categorical`) -> [..., V, E]."""
    if categorical is None:
        return reals(x)
    n = reals.n_vars
    return torch.cat([reals(x[..., :n]), categorical(x[..., n:])], dim=-2)


def _standardize(x: Tensor, mean: Tensor, std: Tensor, n_real: int) -> Tensor:
    """(x - mean) / std on the first n_real columns of x [..., V]; the rest (categorical ids) as they are."""
    z = (x - mean) / std  # [..., V]: whole buffers, which an fp16 export keeps in float32 by name
    if n_real == x.shape[-1]:
        return z
    return torch.cat([z[..., :n_real], x[..., n_real:]], dim=-1)


class RowsForward(nn.Module):
    """A view whose forward is `model.forward_rows`, so DistributedDataParallel wraps the training path."""

    def __init__(self, model: TemporalFusionTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: Tensor) -> TFTOutput:
        return cast(TFTOutput, self.model.forward_rows(*inputs))
