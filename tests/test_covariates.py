"""User known, static and categorical features in the shared feature code and the model: roles, vocabularies,
the unknown slot, windows at training and serving time, and the model's use of each input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from features.bars import BarDataError, read_bars
from features.categories import UNKNOWN_ID
from features.compute import build_frame, latest_windows, with_vocabularies
from features.config import FeatureConfig
from features.schema import (
    DECODER_KNOWN,
    ENCODER_KNOWN,
    ENCODER_OBSERVED,
    MODEL_INPUTS,
    STATIC_CATEGORICAL,
    STATIC_REAL,
    Kind,
    Role,
)
from features.synth import generate
from features.windows import anchor_rows, gather_windows
from trainer.data import unshared_rows
from trainer.model_config import ModelConfig
from trainer.modeling import TemporalFusionTransformer

BARS = 400
COVARIATES = FeatureConfig(horizon=3, volatility_window=5, user_columns=("regime",), known_columns=("event",),
                           static_columns=("exchange", "scale"), categorical_columns=("exchange", "regime"))


@pytest.fixture(scope="module")
def bars_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two symbols with an event flag (known), a per-symbol scale and exchange (static), and a regime label whose
    last label appears only after the first half of the bars."""
    t = generate(["ES", "NQ"], BARS, seed=3)
    es = np.asarray(t.column("symbol").to_pylist()) == "ES"
    row = np.arange(t.num_rows) % BARS
    t = t.append_column("event", pa.array((row % 40 == 0).astype(np.float64)))
    t = t.append_column("scale", pa.array(np.where(es, 1.0, 1.7)))
    t = t.append_column("exchange", pa.array(np.where(es, "CME", "CBOT")))
    t = t.append_column("regime", pa.array(np.where(row < BARS // 2, row // 50 % 2, 7).astype(np.int64)))
    path = tmp_path_factory.mktemp("covariates") / "bars.parquet"
    pq.write_table(t, path)
    return path


def read(path: Path, config: FeatureConfig = COVARIATES) -> FeatureConfig:
    bars = read_bars(path, None, config.real_columns, label_columns=config.categorical_columns)
    return with_vocabularies(config, bars, int(np.sort(bars.timestamp_ns)[len(bars) // 2]))


def test_roles_schema_and_saved_config(bars_path: Path) -> None:
    config = read(bars_path)
    assert config.vocabulary("regime") == ("0", "1")  # fitted before the cut: 7 is unseen
    assert config.vocabulary("exchange") == ("CBOT", "CME")
    schema = config.schema()
    assert schema.static == ["symbol", "exchange", "scale"]
    assert schema.observed[-1] == "regime" and schema.known[-1] == "event"
    kinds = {(f.name, f.role): f.kind for f in schema.features}
    assert kinds[("exchange", Role.STATIC)] == Kind.CATEGORICAL and kinds[("scale", Role.STATIC)] == Kind.REAL
    assert schema.model_inputs == (*MODEL_INPUTS, STATIC_REAL)
    assert FeatureConfig.from_dict(config.to_dict()) == config
    plain = FeatureConfig(user_columns=("f000",))
    assert set(plain.to_dict()) == {"horizon", "volatility_window", "user_columns", "calendar_tz"}
    assert plain.schema().model_inputs == MODEL_INPUTS


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"user_columns": ("x",), "known_columns": ("x",)}, ["'x'", "--features", "--known-features", "one role"]),
    ({"user_columns": ("x",), "categorical_columns": ("y",)}, ["--categorical-features y", "role"]),
])
def test_a_column_in_two_roles_or_none_is_refused(kwargs: dict[str, tuple[str, ...]], words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        FeatureConfig(**kwargs)  # type: ignore[arg-type]
    assert all(w in str(err.value) for w in words), str(err.value)


def test_bad_categorical_and_static_columns_are_named(bars_path: Path, tmp_path: Path) -> None:
    t = pq.read_table(bars_path)
    floats = tmp_path / "floats.parquet"
    pq.write_table(t.set_column(t.column_names.index("regime"), "regime", t.column("regime").cast(pa.float64())),
                   floats)
    with pytest.raises(BarDataError) as err:
        read(floats)
    assert "'regime'" in str(err.value) and "double" in str(err.value) and "cast it" in str(err.value)
    moving = tmp_path / "moving.parquet"
    scale = np.ones(t.num_rows)
    scale[-1] = 2.0
    pq.write_table(t.set_column(t.column_names.index("scale"), "scale", pa.array(scale)), moving)
    config = read(moving)
    with pytest.raises(ValueError) as varies:
        build_frame(read_bars(moving, None, config.real_columns, label_columns=config.categorical_columns), config)
    assert "static feature 'scale' varies within series NQ" in str(varies.value)
    assert "--known-features" in str(varies.value)
    missing = tmp_path / "missing.parquet"  # a static value left NaN is no change within the series
    pq.write_table(t.set_column(t.column_names.index("scale"), "scale", pa.array(np.full(t.num_rows, np.nan))),
                   missing)
    bars = read_bars(missing, None, config.real_columns, check_user_values=False,
                     label_columns=config.categorical_columns)
    assert build_frame(bars, config).static_real is not None


def test_windows_carry_every_input_and_serving_computes_the_same(bars_path: Path) -> None:
    config = read(bars_path)
    bars = read_bars(bars_path, None, config.real_columns, label_columns=config.categorical_columns)
    frame = build_frame(bars, config)
    L, H = 8, config.horizon
    anchors = anchor_rows(frame, L, require_targets=False)
    assert anchors.max() == frame.series_bounds[-1, 1] - 1 - H  # the decoder reads H future rows
    w = gather_windows(frame, anchors, L)
    es = frame.symbols.index("ES")
    row = frame.series_id[anchors] == es
    assert (w[STATIC_CATEGORICAL][row] == [es, 1 + config.vocabulary("exchange").index("CME")]).all()
    assert (w[STATIC_REAL][row] == 1.0).all() and (w[STATIC_REAL][~row] == 1.7).all()
    # the known flag of each future bar is the flag of the row h bars after the anchor
    event = frame.known[:, -1]
    assert np.array_equal(w[DECODER_KNOWN][:, :, -1], event[anchors[:, None] + np.arange(1, H + 1)])
    # the label unseen in training gets the unknown id, and is reported
    assert frame.unseen["regime"].any() and (frame.observed[frame.unseen["regime"], -1] == UNKNOWN_ID).all()
    # the serving path: the last bars of one series, the known values of the bars and of the H future bars
    k = int(np.flatnonzero(row)[-1])
    a = int(anchors[k])
    rows = np.arange(a - (config.warmup_bars + L) + 1, a + 1)
    o, h, lo, c, v = (x[rows][None] for x in (bars.open, bars.high, bars.low, bars.close, bars.volume))
    latest = latest_windows(frame.timestamp_ns[rows][None], o, h, lo, c, v, [frame.observed[rows, -1].astype(float)],
                            config, L, frame.bar_interval_ns, frame.known[rows][None, :, 4:],
                            frame.known[a + 1:a + 1 + H][None, :, 4:])
    assert np.array_equal(latest.encoder_observed[0], w[ENCODER_OBSERVED][k], equal_nan=True)
    assert np.array_equal(latest.encoder_known[0], w[ENCODER_KNOWN][k])
    assert np.array_equal(latest.decoder_known[0], w[DECODER_KNOWN][k])


CFG = ModelConfig(n_observed=4, n_known=3, static_cardinalities=(2, 3), hidden_size=8, attention_heads=2,
                  dropout=0.0, encoder_length=6, horizon=3, observed_cardinalities=(4,), known_cardinalities=(3,),
                  n_static_real=1)


def inputs(batch: int = 5) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    static = torch.stack([torch.randint(0, n, (batch,), generator=g) for n in CFG.static_cardinalities], dim=1)
    observed = torch.randn(batch, CFG.encoder_length, CFG.n_observed, generator=g)
    observed[..., -1] = torch.randint(0, 4, (batch, CFG.encoder_length), generator=g).float()
    enc_known = torch.randn(batch, CFG.encoder_length, CFG.n_known, generator=g)
    dec_known = torch.randn(batch, CFG.horizon, CFG.n_known, generator=g)
    enc_known[..., -1], dec_known[..., -1] = 2.0, 1.0
    return static, observed, enc_known, dec_known, torch.randn(batch, 1, generator=g)


def test_the_model_reads_every_new_input() -> None:
    torch.manual_seed(0)
    model = TemporalFusionTransformer(CFG).eval()
    model.set_normalization(torch.zeros(4), torch.ones(4), torch.zeros(3), torch.ones(3), torch.ones(3),
                            torch.full((1,), 1.5), torch.full((1,), 0.5))
    x = inputs()
    out = model(*x)
    assert out.static_weights.shape == (5, 3) and out.encoder_weights.shape[-1] == 7
    assert out.decoder_weights.shape[-1] == 3
    for i, column in ((1, -1), (3, -1)):  # an observed id, a known id of the future bars
        changed = list(x)
        changed[i] = x[i].clone()
        changed[i][..., column] = (changed[i][..., column] + 1) % 3
        assert not torch.equal(model(*changed).quantiles, out.quantiles)
    assert not torch.equal(model(*x[:4], x[4] + 1.0).quantiles, out.quantiles)  # the static real
    # the shared-rows training path is the same function
    rows = unshared_rows({STATIC_CATEGORICAL: x[0], ENCODER_OBSERVED: x[1], ENCODER_KNOWN: x[2],
                          DECODER_KNOWN: x[3]})
    again = model.forward_rows(rows[STATIC_CATEGORICAL], rows["row_observed"], rows["row_known"],
                               rows["row_window"], rows["window_rows"], rows[DECODER_KNOWN], x[4])
    torch.testing.assert_close(again.quantiles, out.quantiles)


def test_an_unseen_label_enters_as_a_neutral_zero_embedding_and_training_keeps_it() -> None:
    torch.manual_seed(0)
    model = TemporalFusionTransformer(CFG).train()
    x = inputs()
    x[1][..., -1] = torch.arange(CFG.encoder_length).float() % 4  # the unknown id 0 among the observed ids
    model(*x).quantiles.square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert model.observed_categorical is not None and model.known_categorical is not None
    tables = [e.weight.detach() for e in (*model.static_encoder.embedding.embeddings,
                                          *model.observed_categorical.embeddings, *model.known_categorical.embeddings)
              if isinstance(e, torch.nn.Embedding)]
    assert [float(t[0].abs().max()) == 0.0 for t in tables] == [False, True, True, True]  # symbol 0 is a symbol


def test_a_model_without_new_features_keeps_its_parameters() -> None:
    plain = ModelConfig(n_observed=4, n_known=3, static_cardinalities=(2,), hidden_size=8, attention_heads=2)
    names = set(TemporalFusionTransformer(plain).state_dict())
    assert not [n for n in names if "categorical" in n or "real_embedding" in n or n in ("static_mean", "static_std")]
    assert "static_encoder.embedding.embeddings.0.weight" in names and "observed_embedding.weight" in names
