"""Model outputs -> response messages: quantiles of return and of price, and the explanation."""

from __future__ import annotations

import numpy as np

from features.check import spacing_warning
from features.model_meta import ModelMeta
from features.schema import ATTENTION, DECODER_WEIGHTS, ENCODER_WEIGHTS, QUANTILES, STATIC_WEIGHTS
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.preprocess import Prepared


def price_quantiles(last_close: np.ndarray, log_return: np.ndarray) -> np.ndarray:
    """close[t] * exp(q): [B] x [B, H, Q] -> [B, H, Q] float64 (exp is monotone, so still quantiles)."""
    return last_close[:, None, None] * np.exp(log_return.astype(np.float64))


def _weights(variables: list[str], w: np.ndarray) -> pb.VariableWeights:
    """w: [steps, n_vars] or [n_vars]."""
    w2 = w.reshape(-1, len(variables))
    return pb.VariableWeights(variables=variables, steps=int(w2.shape[0]), weights=w2.ravel().tolist())


def explanation(prepared: Prepared, outputs: dict[str, np.ndarray], meta: ModelMeta, b: int) -> pb.Explanation:
    """Attention and variable-selection weights of window b, with variable names and column times."""
    schema = meta.feature_schema
    attention = outputs[ATTENTION][b]  # [H, L + H]
    return pb.Explanation(
        attention_rows=int(attention.shape[0]), attention_cols=int(attention.shape[1]),
        attention=attention.ravel().tolist(),
        attention_timestamp_ns=np.concatenate([prepared.encoder_timestamp_ns[b],
                                               prepared.future_timestamp_ns[b]]).tolist(),
        static_weights=_weights(schema.static, outputs[STATIC_WEIGHTS][b]),  # [n_static]
        encoder_weights=_weights(schema.observed + schema.known, outputs[ENCODER_WEIGHTS][b]),  # [L, V]
        decoder_weights=_weights(schema.known, outputs[DECODER_WEIGHTS][b]),  # [H, n_known]
    )


def spacing_warnings(prepared: Prepared, interval_ns: int) -> dict[int, tuple[str, ...]]:
    """Window b -> its warning when its encoder bars are mostly further apart than the model's bar interval
    (`features.check.spacing_warning`), after a cheap pass over the batch that rules most windows out."""
    ts = prepared.encoder_timestamp_ns  # [B, L]
    gaps = ts.shape[1] - 1
    if (ts[:, -1] - ts[:, 0] <= gaps * interval_ns).all():
        return {}
    near = np.count_nonzero(np.diff(ts, axis=1) < interval_ns + interval_ns // 2, axis=1)  # [B]
    found = {int(b): spacing_warning(f"series[{b}] ({prepared.symbols[b]}): the bars the model reads", ts[b],
                                     interval_ns) for b in np.flatnonzero(2 * near <= gaps)}
    return {b: (warning,) for b, warning in found.items() if warning}


def build_response(prepared: Prepared, outputs: dict[str, np.ndarray], meta: ModelMeta, version: str,
                   explain: bool) -> pb.PredictResponse:
    """One Forecast per series, in request order. outputs[QUANTILES]: [B, H, Q] float32."""
    q = outputs[QUANTILES].astype(np.float64)  # [B, H, Q]
    prices = price_quantiles(prepared.last_close, q)  # [B, H, Q]
    levels = list(meta.quantiles)
    warnings = spacing_warnings(prepared, meta.bar_interval_ns)
    forecasts = [pb.Forecast(
        symbol=symbol, last_timestamp_ns=int(prepared.last_timestamp_ns[b]),
        last_close=float(prepared.last_close[b]), timestamp_ns=prepared.future_timestamp_ns[b].tolist(),
        quantile_levels=levels, horizon=meta.horizon, log_return=q[b].ravel().tolist(),
        price=prices[b].ravel().tolist(), model_version=version,
        warnings=(*warnings.get(b, ()), *(f"series[{b}] ({symbol}): {note}" for note in prepared.notes[b])),
        explanation=explanation(prepared, outputs, meta, b) if explain else None,  # None: the field unset
    ) for b, symbol in enumerate(prepared.symbols)]
    return pb.PredictResponse(forecasts=forecasts, model_version=version)
