"""The TFT model, its config and the pinball loss, on tiny configs on CPU."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from features.schema import MODEL_INPUTS, MODEL_OUTPUTS
from trainer.loss import pinball_loss
from trainer.model_config import ModelConfig
from trainer.modeling import Dropout, TemporalFusionTransformer, TFTOutput, VariableGRNs

L, H = 6, 3
TINY = ModelConfig(
    n_observed=3,
    n_known=2,
    static_cardinalities=(4, 3),
    hidden_size=8,
    attention_heads=2,
    dropout=0.0,
    encoder_length=L,
    horizon=H,
    quantiles=(0.1, 0.5, 0.9),
    variable_hidden_size=5,  # != hidden_size: exercises the skip projections
)


def make_inputs(cfg: ModelConfig, batch: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    static = torch.stack([torch.randint(0, n, (batch,), generator=g) for n in cfg.static_cardinalities], dim=1)
    return (
        static,  # [B, n_static] int64
        torch.randn(batch, cfg.encoder_length, cfg.n_observed, generator=g),
        torch.randn(batch, cfg.encoder_length, cfg.n_known, generator=g),
        torch.randn(batch, cfg.horizon, cfg.n_known, generator=g),
    )


def make_model(cfg: ModelConfig = TINY, seed: int = 0) -> TemporalFusionTransformer:
    torch.manual_seed(seed)
    return TemporalFusionTransformer(cfg).eval()


# ---- config ----------------------------------------------------------------------------


def test_config_roundtrips_through_json() -> None:
    d = json.loads(json.dumps(TINY.to_dict()))
    assert ModelConfig.from_dict(d) == TINY
    assert (TINY.n_quantiles, TINY.n_encoder_vars, TINY.var_hidden) == (3, 5, 5)
    assert ModelConfig(n_observed=1, n_known=1, static_cardinalities=(1,), hidden_size=12).var_hidden == 12


def test_config_from_dict_names_unknown_keys() -> None:
    with pytest.raises(ValueError, match="hidden_sise"):
        ModelConfig.from_dict({**TINY.to_dict(), "hidden_sise": 3})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 10, "attention_heads": 4}, "divisible"),
        ({"quantiles": (0.5, 0.1)}, "increasing"),
        ({"quantiles": (0.0, 0.5)}, "quantiles"),
        ({"dropout": 1.0}, "dropout"),
        ({"horizon": 0}, "horizon"),
        ({"static_cardinalities": ()}, "static_cardinalities"),
    ],
)
def test_config_rejects_bad_values(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**TINY.to_dict(), **change})


# ---- model outputs ---------------------------------------------------------------------


def test_output_names_are_the_schema_names() -> None:
    assert TFTOutput._fields == MODEL_OUTPUTS


@pytest.mark.parametrize("lstm_layers", [1, 2])
def test_output_shapes(lstm_layers: int) -> None:
    cfg = ModelConfig.from_dict({**TINY.to_dict(), "lstm_layers": lstm_layers})
    out = make_model(cfg)(*make_inputs(cfg, 5))
    assert out.quantiles.shape == (5, H, 3)
    assert out.attention.shape == (5, H, L + H)
    assert out.static_weights.shape == (5, 2)
    assert out.encoder_weights.shape == (5, L, 5)
    assert out.decoder_weights.shape == (5, H, 2)
    assert all(bool(torch.isfinite(t).all()) for t in out)


def test_attention_is_a_causal_distribution() -> None:
    attn = make_model()(*make_inputs(TINY, 4)).attention  # [B, H, L+H]
    torch.testing.assert_close(attn.sum(-1), torch.ones(4, H))
    for i in range(H):  # decoder step i sits at position L + i
        assert bool((attn[:, i, L + i + 1 :] == 0).all()), f"step {i} attends to the future"
        assert bool((attn[:, i, : L + i + 1] > 0).all()), f"step {i} ignores an allowed key"


@pytest.mark.parametrize("lstm_layers", [1, 2])
def test_a_forecast_step_sees_no_later_step_and_every_past_bar(lstm_layers: int) -> None:
    """Outputs, not just the returned attention weights: a step's forecast must not move when a later
    step's known inputs change (the LSTM decoder and the attention values are causal), and must move
    when any past bar changes."""
    cfg = ModelConfig.from_dict({**TINY.to_dict(), "lstm_layers": lstm_layers})
    model = make_model(cfg)
    static, observed, known, future = make_inputs(cfg, 4, seed=5)
    with torch.no_grad():
        base = model(static, observed, known, future).quantiles  # [B, H, Q]
        for j in range(H):
            changed = future.clone()
            changed[:, j] += 3.0
            q = model(static, observed, known, changed).quantiles
            assert torch.equal(q[:, :j], base[:, :j]), f"steps before {j} see step {j}'s known inputs"
            assert bool((q[:, j] != base[:, j]).any()), f"step {j} ignores its own known inputs"
        for bar in (0, L - 1):
            changed = observed.clone()
            changed[:, bar] += 3.0
            q = model(static, changed, known, future).quantiles
            assert bool((q != base).any(dim=-1).all()), f"some step ignores encoder bar {bar}"


def test_selection_weights_are_distributions_over_variables() -> None:
    out = make_model()(*make_inputs(TINY, 4))
    for w in (out.static_weights, out.encoder_weights, out.decoder_weights):
        assert bool((w >= 0).all())
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))


def test_quantiles_never_cross_even_with_random_weights() -> None:
    cfg = ModelConfig.from_dict({**TINY.to_dict(), "quantiles": (0.02, 0.1, 0.25, 0.5, 0.75, 0.9, 0.98)})
    for seed in range(5):
        model = make_model(cfg, seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 3.0)
        q = model(*make_inputs(cfg, 16, seed=seed)).quantiles
        assert bool((q.diff(dim=-1) >= 0).all()), f"quantiles cross with seed {seed}"


@pytest.mark.parametrize("batch", [1, 7])
def test_each_row_is_independent_of_the_batch(batch: int) -> None:
    model = make_model()
    inputs = make_inputs(TINY, batch, seed=3)
    full = model(*inputs)
    alone = model(*(x[-1:] for x in inputs))  # the last row on its own
    for name, a, b in zip(MODEL_OUTPUTS, full, alone, strict=True):
        assert a.shape[0] == batch
        torch.testing.assert_close(a[-1:], b, msg=name)


def test_batched_variable_grns_equal_one_grn_per_variable() -> None:
    torch.manual_seed(0)
    grns = VariableGRNs(n_vars=4, input_size=3, hidden_size=6, dropout=0.0)
    x = torch.randn(10, 4, 3)  # [N, V, E]
    out = grns(x)  # [N, V, D]
    for v in range(4):
        w = {name: p[v] for name, p in grns.named_parameters()}  # this variable's own weights

        def lin(t: Tensor, name: str, w: dict[str, Tensor] = w) -> Tensor:
            return t @ w[f"{name}.weight"] + w[f"{name}.bias"][0]

        h = lin(nn.functional.elu(lin(x[:, v], "fc1")), "fc2")
        h = nn.functional.glu(lin(h, "gate"), dim=-1)
        y = nn.functional.layer_norm(lin(x[:, v], "skip") + h, (6,), w["norm_weight"][0], w["norm_bias"][0])
        torch.testing.assert_close(out[:, v], y)


# ---- normalisation -------------------------------------------------------------------


FIXED = dataclasses.replace(TINY, quantile_scale="fixed")


def test_target_scale_scales_fixed_quantiles_and_nothing_else() -> None:
    model = make_model(FIXED)
    inputs = make_inputs(TINY, 4)
    before = model(*inputs)
    scale = np.array([2.0, 0.5, 3.0], dtype=np.float32)
    model.set_normalization(np.zeros(3), np.ones(3), np.zeros(2), np.ones(2), scale)
    after = model(*inputs)
    torch.testing.assert_close(after.quantiles, before.quantiles * torch.from_numpy(scale)[None, :, None])
    torch.testing.assert_close(after.encoder_weights, before.encoder_weights)


def test_an_untrained_model_forecasts_the_encoder_bars_gaussian_volatility() -> None:
    """quantile_scale "volatility": before training, q(h) = sqrt(h) * ewma_rms(encoder log returns) * z_q, the
    RiskMetrics forecast (decay 0.94 per bar), with a median at zero drift."""
    model = make_model()
    static, obs, enc_k, dec_k = make_inputs(TINY, 4)
    obs[..., 0] *= torch.tensor([0.5, 1.0, 2.0, 4.0])[:, None]  # windows of different volatility
    weights = 0.94 ** torch.arange(L - 1, -1, -1).float()  # the last bar weighs most
    sigma = (obs[..., 0].square() * weights / weights.sum()).sum(dim=1).sqrt()  # [B]; the floor is negligible
    z = torch.tensor([-1.2815516, 0.0, 1.2815516])
    scale = sigma[:, None, None] * torch.arange(1, H + 1).sqrt()[None, :, None]  # [B, H, 1]
    got = model(static, obs, enc_k, dec_k).quantiles
    assert bool(((got - scale * z).abs() <= 0.02 * scale).all()), (got / scale, z)
    later = obs.clone()
    later[:, -1, 0] = 10.0  # a big last return moves the scale more than the same return first
    earlier = obs.clone()
    earlier[:, 0, 0] = 10.0
    assert bool((model(static, later, enc_k, dec_k).quantiles[:, :, -1] >
                 model(static, earlier, enc_k, dec_k).quantiles[:, :, -1]).all())


def test_input_normalization_is_folded_into_the_model() -> None:
    plain, fitted = make_model(FIXED), make_model(FIXED)
    o_mean, o_std = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.1, 3.0, 2.0])
    k_mean, k_std = torch.tensor([5.0, 0.0]), torch.tensor([2.0, 0.01])
    fitted.set_normalization(o_mean, o_std, k_mean, k_std, torch.ones(H))
    static, obs, enc_k, dec_k = make_inputs(TINY, 4)  # these play the normalised features
    raw = (static, obs * o_std + o_mean, enc_k * k_std + k_mean, dec_k * k_std + k_mean)
    expected, got = plain(static, obs, enc_k, dec_k), fitted(*raw)
    torch.testing.assert_close(got.quantiles, expected.quantiles, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(plain(*raw).quantiles, expected.quantiles, atol=1e-3)


def test_set_normalization_rejects_bad_statistics() -> None:
    model = make_model()
    ok = {
        "observed_mean": np.zeros(3),
        "observed_std": np.ones(3),
        "known_mean": np.zeros(2),
        "known_std": np.ones(2),
        "target_scale": np.ones(H),
    }
    bad = {
        "observed_std": np.array([1.0, 0.0, 1.0]),
        "target_scale": np.ones(H + 1),
        "known_mean": np.array([np.nan, 0.0]),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            model.set_normalization(**{**ok, name: value})
    model.set_normalization(**ok)  # the good statistics pass


# ---- gradient checkpointing --------------------------------------------------------------


def _loss_and_grads(model: TemporalFusionTransformer, checkpointing: bool) -> dict[str, Tensor]:
    model.train()
    model.gradient_checkpointing = checkpointing
    model.zero_grad()
    inputs = make_inputs(model.cfg, 6, seed=1)
    target = torch.randn(6, model.cfg.horizon, generator=torch.Generator().manual_seed(2))
    pinball_loss(model(*inputs).quantiles, target, model.cfg.quantiles).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_identical_gradients() -> None:
    model = make_model()
    plain, ckpt = _loss_and_grads(model, False), _loss_and_grads(model, True)
    assert plain.keys() == ckpt.keys() == {n for n, _ in model.named_parameters()}
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=0, msg=name)


def test_gradient_checkpointing_saves_fewer_activations() -> None:
    def saved_bytes(checkpointing: bool) -> int:
        model = make_model()
        model.train()
        model.gradient_checkpointing = checkpointing
        total = 0

        def pack(t: Tensor) -> Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*make_inputs(TINY, 32)).quantiles.sum().backward()
        return total

    plain, ckpt = saved_bytes(False), saved_bytes(True)
    assert ckpt < plain / 2, f"checkpointing saves {ckpt} bytes vs {plain} without"


# ---- loss ------------------------------------------------------------------------------


def test_pinball_loss_known_values() -> None:
    pred = torch.zeros(2, 1, 3)  # [B, H, Q]
    target = torch.tensor([[1.0], [-1.0]])  # one above, one below every quantile
    loss = pinball_loss(pred, target, [0.1, 0.5, 0.9])
    # above: q * 1; below: (1 - q) * 1; mean of the two is 0.5 for every q
    torch.testing.assert_close(loss, torch.full((3,), 0.5))
    above = pinball_loss(pred[:1], target[:1], [0.1, 0.5, 0.9])
    torch.testing.assert_close(above, torch.tensor([0.1, 0.5, 0.9]))


# ---- ONNX export -----------------------------------------------------------------------


def _export(model: nn.Module, inputs: tuple[Tensor, ...], path: Path, mode: str) -> None:
    names, outputs = list(MODEL_INPUTS), list(MODEL_OUTPUTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings from nn.LSTM's own shape checks; deprecations
        if mode == "dynamo":
            batch = torch.export.Dim("batch", min=1)
            torch.onnx.export(
                model,
                inputs,
                str(path),
                input_names=names,
                output_names=outputs,
                opset_version=18,
                dynamo=True,
                external_data=False,
                dynamic_shapes={name: {0: batch} for name in MODEL_INPUTS},
            )
        else:
            torch.onnx.export(
                model,
                inputs,
                str(path),
                input_names=names,
                output_names=outputs,
                opset_version=17,
                dynamo=False,
                dynamic_axes={name: {0: "batch"} for name in (*MODEL_INPUTS, *MODEL_OUTPUTS)},
            )


@pytest.mark.parametrize("mode", ["dynamo", "torchscript"])
def test_onnx_export_matches_pytorch_at_any_batch(mode: str, tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    cfg = ModelConfig.from_dict({**TINY.to_dict(), "dropout": 0.1, "lstm_layers": 2})
    model = make_model(cfg)
    model.gradient_checkpointing = True  # must be a no-op in eval mode
    model.set_normalization(np.full(3, 0.5), np.full(3, 2.0), np.full(2, -1.0), np.full(2, 0.5), np.arange(1, H + 1))
    path = tmp_path / "tft.onnx"
    _export(model, make_inputs(cfg, 2), path, mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tft.onnx"]  # one self-contained file

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(MODEL_INPUTS)
    assert [o.name for o in session.get_outputs()] == list(MODEL_OUTPUTS)
    for batch in (1, 7):
        inputs = make_inputs(cfg, batch, seed=batch)
        with torch.no_grad():
            expected = model(*inputs)
        got = session.run(None, {n: x.numpy() for n, x in zip(MODEL_INPUTS, inputs, strict=True)})
        for name, e, g in zip(MODEL_OUTPUTS, expected, got, strict=True):
            assert g.shape == tuple(e.shape), name
            np.testing.assert_allclose(g, e.numpy(), atol=1e-4, rtol=0, err_msg=f"{name} at batch {batch}")


def test_dropout_zeroes_a_share_p_scales_the_rest_and_is_the_identity_in_eval() -> None:
    torch.manual_seed(0)
    drop = Dropout(0.25).train()
    x = torch.ones(200_000, requires_grad=True)
    y = drop(x)
    kept = y != 0
    assert abs(1.0 - float(kept.float().mean()) - 0.25) < 0.01
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.75))  # the expectation is kept
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, y.detach())  # the gradient takes the same mask
    assert not torch.equal(drop(x), y)  # a new mask each call
    z = torch.randn(5)
    assert drop.eval()(z) is z and Dropout(0.0).train()(z) is z

