"""The forecasts a desk already has, on the model's origins: climatology, rolling volatility, GARCH(1,1)-t, and where
the bars' clock makes them meaningful, seasonal GARCH (intraday bars) and HAR-RV (a horizon of a session or more).

Every baseline forecasts the quantiles of the h-bar log return log(close[t+h] / close[t]), h = 1..H, at each origin row
t, from the bars up to and including t. Climatology, both GARCHs (and the seasonal one's intraday profile) and HAR-RV
learn only from the fold's training rows (< train_end); rolling volatility, the GARCH filters and HAR-RV's realized
variances then read the bars up to the origin, never after it. The future bars' times (which slot of the profile, which
trading day) are the series' next rows' timestamps where they exist, as an exchange calendar knows them ahead, else the
last bar's time plus whole bar intervals.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from backtest.folds import BacktestError
from features.calendar import NS_PER_DAY, profile_slots, sessions

BASELINES = ("climatology", "rolling_vol", "garch", "seasonal_garch", "har_rv")
ANY_BARS = BASELINES[:3]  # the baselines of any bars; seasonal_garch and har_rv read the bars' clock (BarClock)

MIN_SLOT_RETURNS = 5  # a profile slot with fewer training returns takes the overall RMS
PROFILE_FLOOR = 0.1  # no slot's profile below this share of the overall RMS: a near-flat slot divides by ~0 never
STUB_SESSION = 0.5  # a calendar day with fewer bars than this share of the median joins the next (a Sunday open)
WEEK_DAYS, MONTH_DAYS = 5, 22  # HAR-RV's weekly and monthly realized-variance means, in trading days
MIN_HAR_DAYS = 60  # complete training days the HAR-RV regression needs
RV_FLOOR = 0.01  # no HAR-RV variance forecast below this share of the mean training-day RV


@dataclass(frozen=True)
class BarClock:
    """When a series' bars are: what the seasonal GARCH's profile and HAR-RV's trading days read."""

    timestamp_ns: np.ndarray  # int64 [N]  each bar's time (UTC)
    bar_interval_ns: int  # the bars' nominal spacing
    tz: str = "UTC"  # calendar time zone of the profile's slots and of the trading days (FeatureConfig.calendar_tz)

    @property
    def intraday(self) -> bool:
        return 0 < self.bar_interval_ns < NS_PER_DAY


@dataclass(frozen=True)
class Season:
    """An intraday volatility profile (unit RMS over the training returns) at a series' rows and future bars."""

    rows: np.ndarray  # float64 [N]     the profile at each row: its return is divided by it
    ahead: np.ndarray  # float64 [W, H]  at each origin's h-th future bar: its variance is multiplied by its square


def baseline_names(bar_interval_ns: int, horizon: int, session_bars: float) -> tuple[str, ...]:
    """The baselines of bars `bar_interval_ns` apart, `session_bars` (median) to a trading day: seasonal_garch for
    intraday bars, har_rv for daily bars or a horizon that spans a session."""
    intraday = 0 < bar_interval_ns < NS_PER_DAY
    spans = not intraday or horizon >= session_bars
    return (*ANY_BARS, *(("seasonal_garch",) if intraday else ()), *(("har_rv",) if spans else ()))


def baseline_forecasts(close: np.ndarray, train_end: int, origins: np.ndarray, horizon: int,
                       quantiles: Sequence[float], window: int, *, series: str = "the series",
                       clock: BarClock | None = None, names: Sequence[str] = ANY_BARS) -> dict[str, np.ndarray]:
    """Each baseline of `names` at `origins` of one series' closes [N]: name -> [W, H, Q]. seasonal_garch (intraday
    bars) and har_rv need the bars' `clock`. `series` names the series in the error a failed fit raises."""
    log_returns = np.concatenate([[np.nan], np.diff(np.log(close))])  # [N], row t: log(close[t] / close[t-1])
    season = None
    if clock is not None and clock.intraday and {"seasonal_garch", "har_rv"} & set(names):
        season = season_of(log_returns, clock, train_end, origins, horizon)
    makers: dict[str, Callable[[], np.ndarray]] = {
        "climatology": lambda: climatology_forecast(close, train_end, origins, horizon, quantiles),
        "rolling_vol": lambda: rolling_vol_forecast(log_returns, origins, horizon, quantiles, window),
        "garch": lambda: garch_forecast(log_returns, train_end, origins, horizon, quantiles, series=series),
    }
    if season is not None:
        makers["seasonal_garch"] = lambda: garch_forecast(log_returns, train_end, origins, horizon, quantiles,
                                                          series=series, season=season)
    if clock is not None:
        makers["har_rv"] = lambda: har_rv_forecast(log_returns, clock, train_end, origins, horizon, quantiles,
                                                   series=series, season=season)
    return {name: makers[name]() for name in names}


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
    normal = np.array([NormalDist().inv_cdf(q) for q in quantiles])  # [Q]
    return _scaled(sigma[:, None] ** 2 * np.arange(1, horizon + 1), normal)


def garch_forecast(log_returns: np.ndarray, train_end: int, origins: np.ndarray, horizon: int,
                   quantiles: Sequence[float], *, series: str = "the series", season: Season | None = None
                   ) -> np.ndarray:
    """GARCH(1,1), zero mean, standardised Student-t innovations, fitted on the training rows' returns and filtered
    forward to the last origin with those parameters fixed; the h-step quantile is the square root of the summed 1..h
    step variance forecasts times the fitted t's quantile: [W, H, Q]. With `season` (the seasonal GARCH) it is fitted
    and filtered on the returns divided by their bars' profile, and each future bar's variance forecast is multiplied by
    its bar's profile squared. `log_returns` [N]: row t holds log(close[t] / close[t-1]), NaN at row 0."""
    from arch import arch_model  # the optional extra `.[eval]`; imported where it is used

    returns = log_returns[1:] if season is None else log_returns[1:] / season.rows[1:]  # [N - 1], p is row p + 1
    scale = float(np.std(returns[: train_end - 1]))  # unit variance keeps arch's optimiser well conditioned
    label = "GARCH(1,1)-t" if season is None else "seasonal GARCH(1,1)-t"
    params = _garch_fit(returns[: train_end - 1] / scale, f"{series}: the {label} fit on {train_end} training bars")
    # The backcast reads the first bars, which are training bars; each variance uses returns up to its row.
    seen = returns[: int(origins.max())] / scale  # up to the last origin's row: later bars change nothing
    model = arch_model(seen, mean="Zero", vol="GARCH", p=1, q=1, dist="t")
    fixed = model.fix(params)
    start = int(origins.min()) - 1  # the position of the first origin's last return
    variance = fixed.forecast(horizon=horizon, start=start, reindex=False, method="analytic").variance.to_numpy()
    step_var = variance[origins - 1 - start] * scale**2  # [W, H], the 1-bar variance h steps ahead
    if season is not None:
        step_var = step_var * season.ahead**2
    t_ppf = model.distribution.ppf(np.asarray(quantiles, dtype=np.float64), [float(params["nu"])])  # [Q]
    return _scaled(np.cumsum(step_var, axis=1), np.asarray(t_ppf))


GARCH_RESTART = np.array([0.05, 0.1, 0.85, 8.0])  # omega, alpha, beta, nu: a typical fit of unit-variance returns


def _garch_fit(train: np.ndarray, what: str) -> Any:
    """The fitted GARCH(1,1)-t parameters of unit-variance training returns `train`, from arch's starting values or,
    where its line search stalls there, from GARCH_RESTART; BacktestError when neither converges (`what` names it)."""
    from arch import arch_model
    from arch.utility.exceptions import ConvergenceWarning

    model = arch_model(train, mean="Zero", vol="GARCH", p=1, q=1, dist="t")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # a failed fit raises below, by its flag
        fit = model.fit(disp="off")
        if fit.convergence_flag != 0:
            fit = model.fit(disp="off", starting_values=GARCH_RESTART)
    if fit.convergence_flag != 0:
        raise BacktestError(f"{what} did not converge ({fit.optimization_result.message}); give the folds more "
                            "training bars (a smaller --test-span or fewer --folds)")
    return fit.params


def season_of(log_returns: np.ndarray, clock: BarClock, train_end: int, origins: np.ndarray, horizon: int
              ) -> Season:
    """The intraday profile fitted on the training rows' returns, at every row and at the origins' future bars."""
    slots, n_slots = profile_slots(clock.timestamp_ns, clock.bar_interval_ns, clock.tz)  # [N]
    profile = intraday_profile(log_returns[:train_end], slots[:train_end], n_slots)  # [n_slots]
    ahead, _ = profile_slots(future_times(clock, origins, horizon), clock.bar_interval_ns, clock.tz)  # [W, H]
    return Season(profile[slots], profile[ahead])


def intraday_profile(log_returns: np.ndarray, slots: np.ndarray, n_slots: int) -> np.ndarray:
    """The RMS of the returns [T] by slot [T] over the RMS of them all, [n_slots]: a slot with fewer than
    MIN_SLOT_RETURNS returns takes 1 (the overall RMS), none goes below PROFILE_FLOOR. NaN returns are left out."""
    ok = np.isfinite(log_returns)
    r2, s = log_returns[ok] ** 2, slots[ok]
    count = np.bincount(s, minlength=n_slots)  # [n_slots]
    total = np.bincount(s, weights=r2, minlength=n_slots)  # [n_slots]
    overall = float(np.sqrt(r2.mean()))
    rms = np.where(count >= MIN_SLOT_RETURNS, np.sqrt(total / np.maximum(count, 1)), overall)
    return np.maximum(rms, PROFILE_FLOOR * overall) / overall


def future_times(clock: BarClock, origins: np.ndarray, horizon: int) -> np.ndarray:
    """The times of each origin's next `horizon` bars: the series' next rows' timestamps where they exist, else the
    last bar's time plus whole bar intervals. int64 [W, H]."""
    ts, last = clock.timestamp_ns, clock.timestamp_ns.size - 1
    rows = origins[:, None] + np.arange(1, horizon + 1)  # [W, H]
    nominal = ts[last] + (rows - last) * np.int64(clock.bar_interval_ns)
    return np.where(rows <= last, ts[np.minimum(rows, last)], nominal)


def har_rv_forecast(log_returns: np.ndarray, clock: BarClock, train_end: int, origins: np.ndarray, horizon: int,
                    quantiles: Sequence[float], *, series: str = "the series", season: Season | None = None
                    ) -> np.ndarray:
    """HAR-RV (Corsi 2009): each trading day's realized variance RV (the sum of its bars' squared log returns;
    a daily bar's squared return) regressed by least squares on the day before's RV and the means over the last 5
    and 22 days, on training days only; iterated day by day from the origin's last complete day. A future bar's
    variance is its day's RV forecast over the median bars per training day, times its bar's intraday profile
    squared (`season`; 1 without). The h-step quantile is the square root of the summed 1..h variances times the
    empirical quantile of the training days' returns standardised by their fitted RV: [W, H, Q]."""
    day = trading_days(clock.timestamp_ns, clock.tz)  # [N]
    rv, day_return = realized_variance(log_returns, day)  # [D], [D]
    n_train = int(day[train_end]) if train_end < day.size else int(day[-1]) + 1  # days all before train_end
    if n_train < MIN_HAR_DAYS:
        raise BacktestError(f"{series}: HAR-RV needs {MIN_HAR_DAYS} complete training days, the fold has {n_train}; "
                            "give the folds more training bars (a smaller --test-span or fewer --folds)")
    coef = har_fit(rv[:n_train])  # [4]
    floor = RV_FLOOR * float(rv[:n_train].mean())
    fitted = np.maximum(har_design(rv[:n_train])[:-1] @ coef, floor)  # [n_train - 22], days 22 .. n_train - 1
    unit = np.quantile(day_return[MONTH_DAYS:n_train] / np.sqrt(fitted), quantiles)  # [Q]
    last = last_complete_day(day, origins)  # [W]
    steps = np.maximum(future_days(day, clock, origins, horizon) - last[:, None], 1)  # [W, H], days ahead
    history = rv[last[:, None] + np.arange(1 - MONTH_DAYS, 1)]  # [W, 22], up to the last complete day
    path = har_path(history, coef, int(steps.max()), floor)  # [W, M]
    per_bar = (1.0 if season is None else season.ahead**2) / np.median(np.bincount(day[:train_end])[:n_train])
    variance = np.take_along_axis(path, steps - 1, axis=1) * per_bar  # [W, H]
    return _scaled(np.cumsum(variance, axis=1), unit)


def trading_days(timestamp_ns: np.ndarray, tz: str) -> np.ndarray:
    """Each bar's trading day 0, 1, ...: its calendar day in `tz` (features.calendar.sessions), a day with fewer
    bars than STUB_SESSION of the median joining the next day (a Sunday evening open joins Monday). int64 [N]."""
    session = sessions(timestamp_ns, tz)  # [N], non-decreasing
    first = np.flatnonzero(np.diff(session, prepend=session[0] - 1))  # [D0], each calendar day's first row
    counts = np.diff(np.append(first, session.size))  # [D0]
    keep = counts >= STUB_SESSION * np.median(counts)
    keep[-1] = True
    day_of = np.searchsorted(np.flatnonzero(keep), np.arange(counts.size))  # [D0], the kept day at or after each
    return np.repeat(day_of, counts).astype(np.int64)


def realized_variance(log_returns: np.ndarray, day: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per trading day, the sum of its bars' squared log returns (RV) and of its log returns: [D], [D]."""
    r = np.nan_to_num(log_returns)
    return np.bincount(day, weights=r**2), np.bincount(day, weights=r)


def har_design(rv: np.ndarray) -> np.ndarray:
    """HAR's regressors at the end of days 21 .. D - 1 of daily RV [D]: 1, RV, its 5- and 22-day means: [D - 21, 4]."""
    cum = np.concatenate([[0.0], np.cumsum(rv)])  # [D + 1], sum of days < i
    k = np.arange(MONTH_DAYS - 1, rv.size)
    weekly = (cum[k + 1] - cum[k + 1 - WEEK_DAYS]) / WEEK_DAYS
    monthly = (cum[k + 1] - cum[k + 1 - MONTH_DAYS]) / MONTH_DAYS
    return np.stack([np.ones(k.size), rv[k], weekly, monthly], axis=1)


def har_fit(rv: np.ndarray) -> np.ndarray:
    """The HAR coefficients (b0, b_day, b_week, b_month) of daily RV [D] by least squares: RV of day k + 1 on
    har_design's regressors at day k. [4]."""
    coef, *_ = np.linalg.lstsq(har_design(rv)[:-1], rv[MONTH_DAYS:], rcond=None)
    return np.asarray(coef)


def har_path(history: np.ndarray, coef: np.ndarray, days: int, floor: float) -> np.ndarray:
    """HAR's RV forecasts 1 .. `days` days after each row of the last 22 days' RV [W, 22], each forecast feeding
    the next, none below `floor`: [W, days]."""
    window = history.copy()
    out = np.empty((history.shape[0], days))
    for m in range(days):
        x = np.stack([np.ones(window.shape[0]), window[:, -1], window[:, -WEEK_DAYS:].mean(axis=1),
                      window.mean(axis=1)], axis=1)  # [W, 4]
        out[:, m] = np.maximum(x @ coef, floor)
        window = np.concatenate([window[:, 1:], out[:, m:m + 1]], axis=1)
    return out


def last_complete_day(day: np.ndarray, origins: np.ndarray) -> np.ndarray:
    """Each origin's last trading day with all its bars up to the origin: its own day when the origin is the day's
    last row (or the series' last), else the day before. [W]."""
    nxt = np.minimum(origins + 1, day.size - 1)
    closes_day = (origins == day.size - 1) | (day[nxt] != day[origins])
    return day[origins] - np.where(closes_day, 0, 1)


def future_days(day: np.ndarray, clock: BarClock, origins: np.ndarray, horizon: int) -> np.ndarray:
    """The trading day of each origin's next `horizon` bars: the next rows' where they exist, else counted on in
    calendar days from the last bar's. int64 [W, H]."""
    last = day.size - 1
    rows = origins[:, None] + np.arange(1, horizon + 1)  # [W, H]
    beyond = sessions(future_times(clock, origins, horizon), clock.tz) - sessions(clock.timestamp_ns[last:], clock.tz)
    return np.where(rows <= last, day[np.minimum(rows, last)], day[last] + beyond)


def _scaled(variance: np.ndarray, unit_quantiles: np.ndarray) -> np.ndarray:
    """Quantiles of a variable of `variance` [W, H] whose standardised quantiles are `unit_quantiles` [Q]: [W, H, Q]."""
    return np.sqrt(variance)[..., None] * unit_quantiles
