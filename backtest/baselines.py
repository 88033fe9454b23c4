"""The forecasts a desk already has, on the model's origins: climatology, rolling volatility, GARCH(1,1)-t.

Every baseline forecasts the quantiles of the h-bar log return log(close[t+h] / close[t]), h = 1..H, at each
origin row t, from the bars up to and including t. Climatology and GARCH learn only from the fold's training
rows (< train_end); rolling volatility and GARCH's filter then read the bars up to the origin, never after it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from backtest.folds import BacktestError

BASELINES = ("climatology", "rolling_vol", "garch")


def baseline_forecasts(close: np.ndarray, train_end: int, origins: np.ndarray, horizon: int,
                       quantiles: Sequence[float], window: int, *, series: str = "the series") -> dict[str, np.ndarray]:
    """Each baseline's quantile forecasts at `origins` of one series' closes [N]: name -> [W, H, Q].
    `series` names the series in the error a failed GARCH fit raises."""
    log_returns = np.concatenate([[np.nan], np.diff(np.log(close))])  # [N], row t: log(close[t] / close[t-1])
    return {
        "climatology": climatology_forecast(close, train_end, origins, horizon, quantiles),
        "rolling_vol": rolling_vol_forecast(log_returns, origins, horizon, quantiles, window),
        "garch": garch_forecast(log_returns, train_end, origins, horizon, quantiles, series=series),
    }


def climatology_forecast(close: np.ndarray, train_end: int, origins: np.ndarray, horizon: int,
                         quantiles: Sequence[float]) -> np.ndarray:
    """Per step h, the empirical quantiles of the h-bar log returns inside the training rows (t + h < train_end),
    the same at every origin: [W, H, Q]."""
    log_close = np.log(close[:train_end])  # [T]
    clim = np.stack([np.quantile(log_close[h:] - log_close[:-h], quantiles) for h in range(1, horizon + 1)])  # [H, Q]
    return np.repeat(clim[None], origins.shape[0], axis=0)


def rolling_vol_forecast(log_returns: np.ndarray, origins: np.ndarray, horizon: int, quantiles: Sequence[float],
                         window: int) -> np.ndarray:
    """Zero-mean Gaussian quantiles sqrt(h) * sigma_t * Phi^-1(q), sigma_t the root mean square of the last
    `window` 1-bar log returns up to and including row t (fewer where fewer exist): [W, H, Q]."""
    squares = np.concatenate([[0.0], np.cumsum(np.nan_to_num(log_returns) ** 2)])  # [N + 1], sum of rows < i
    hi = origins + 1  # the window is rows [lo, t]; row 0 has no return
    lo = np.maximum(1, hi - window)
    sigma = np.sqrt((squares[hi] - squares[lo]) / (hi - lo))  # [W]
    return _scaled(sigma[:, None] ** 2 * np.arange(1, horizon + 1), _normal_ppf(quantiles))


def garch_forecast(log_returns: np.ndarray, train_end: int, origins: np.ndarray, horizon: int,
                   quantiles: Sequence[float], *, series: str = "the series") -> np.ndarray:
    """GARCH(1,1), zero mean, standardised Student-t innovations, fitted on the training rows' returns and
    filtered forward to the last origin with those parameters fixed; the h-step quantile is the square root of the
    summed 1..h step variance forecasts times the fitted t's quantile: [W, H, Q].
    `log_returns` [N]: row t holds log(close[t] / close[t-1]), NaN at row 0."""
    from arch import arch_model  # the optional extra `.[eval]`; imported where it is used
    from arch.utility.exceptions import ConvergenceWarning

    returns = log_returns[1:]  # [N - 1], position p is row p + 1
    scale = float(np.std(returns[: train_end - 1]))  # unit variance keeps arch's optimiser well conditioned
    model = arch_model(returns[: train_end - 1] / scale, mean="Zero", vol="GARCH", p=1, q=1, dist="t")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # a failed fit raises below, by its flag
        fit = model.fit(disp="off")
    if fit.convergence_flag != 0:
        raise BacktestError(f"{series}: the GARCH(1,1)-t fit on {train_end} training bars did not converge "
                            f"({fit.optimization_result.message}); give the folds more training bars (a smaller "
                            "--test-span or fewer --folds)")
    # The backcast reads the first bars, which are training bars; each variance uses returns up to its row.
    seen = returns[: int(origins.max())] / scale  # up to the last origin's row: later bars change nothing
    fixed = arch_model(seen, mean="Zero", vol="GARCH", p=1, q=1, dist="t").fix(fit.params)
    start = int(origins.min()) - 1  # the position of the first origin's last return
    variance = fixed.forecast(horizon=horizon, start=start, reindex=False, method="analytic").variance.to_numpy()
    step_var = variance[origins - 1 - start] * scale**2  # [W, H], the 1-bar variance h steps ahead
    t_ppf = model.distribution.ppf(np.asarray(quantiles, dtype=np.float64), [float(fit.params["nu"])])  # [Q]
    return _scaled(np.cumsum(step_var, axis=1), np.asarray(t_ppf))


def _normal_ppf(quantiles: Sequence[float]) -> np.ndarray:
    return np.array([NormalDist().inv_cdf(q) for q in quantiles])  # [Q]


def _scaled(variance: np.ndarray, unit_quantiles: np.ndarray) -> np.ndarray:
    """Quantiles of a zero-mean variable with `variance` [W, H] and unit-variance quantiles [Q]: [W, H, Q]."""
    return np.sqrt(variance)[..., None] * unit_quantiles
