"""How bars become features (`FeatureConfig`, saved with every checkpoint and model) and the feature schema it
implies: the built-in variables, then the user's, in the column order of every array."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from features.calendar import check_time_zone
from features.contracts import ContractConfig, roll_sessions
from features.schema import FeatureSchema, FeatureSpec, Kind, Role

BUILTIN_OBSERVED: tuple[str, ...] = ("log_return", "log_range", "log_body", "log_volume", "volatility")
BUILTIN_KNOWN: tuple[str, ...] = ("tod_sin", "tod_cos", "dow_sin", "dow_cos")
# after the calendar, for a model rolling by `calendar:N` (expirations known, so known ahead; a volume roll is not)
CONTRACT_KNOWN: tuple[str, ...] = ("sessions_to_expiry", "roll_session")
STATIC_SYMBOL = "symbol"


@dataclass(frozen=True)
class FeatureConfig:
    """How bars become features; saved with every checkpoint and model.

    User columns come in three roles: observed (`user_columns`, encoder only), known for future bars
    (`known_columns`, encoder and decoder) and static (`static_columns`, constant per series). Those named in
    `categorical_columns` are labels, embedded by id with the `vocabularies` fitted on the training split."""

    horizon: int = 5  # forecast steps H: targets are log(close[t+h]/close[t]) for h = 1..H
    volatility_window: int = 20  # bars in the rolling standard deviation of log returns
    user_columns: tuple[str, ...] = ()  # user columns observed up to the last bar (encoder only)
    calendar_tz: str = "UTC"  # IANA time zone of the calendar features (time of day, day of week)
    known_columns: tuple[str, ...] = ()  # user columns whose future values the caller knows
    static_columns: tuple[str, ...] = ()  # user columns constant within a series
    categorical_columns: tuple[str, ...] = ()  # which user columns, of any role, are categorical
    vocabularies: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (column, sorted labels) once fitted
    contracts: ContractConfig | None = None  # per-contract bars rolled into one series per root; None: as given
    # (series, learn_hours' ranges) fitted on the training split: where future bars fall; absent: every interval
    trading_hours: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.horizon < 1 or self.volatility_window < 1:
            raise ValueError(f"horizon ({self.horizon}) and volatility_window ({self.volatility_window}) "
                             "must be at least 1")
        check_time_zone(self.calendar_tz)
        check_roles(self)

    @property
    def warmup_bars(self) -> int:
        return self.volatility_window

    # The user variables by role and kind, as the schema orders them (FeatureSchema.user)
    @property
    def known_reals(self) -> tuple[str, ...]:
        """The known real user columns: their future values travel in the wire's future_features."""
        return self.schema().user(Role.KNOWN, kind=Kind.REAL)

    @property
    def known_categoricals(self) -> tuple[str, ...]:
        """The known categorical user columns: their future labels travel in future_categorical_features."""
        return self.schema().user(Role.KNOWN, kind=Kind.CATEGORICAL)

    @property
    def observed_user(self) -> tuple[str, ...]:
        return self.schema().user(Role.OBSERVED)

    @property
    def known_user(self) -> tuple[str, ...]:
        return self.schema().user(Role.KNOWN)

    @property
    def static_categoricals(self) -> tuple[str, ...]:
        return self.schema().user(Role.STATIC, kind=Kind.CATEGORICAL)

    @property
    def static_reals(self) -> tuple[str, ...]:
        return self.schema().user(Role.STATIC, kind=Kind.REAL)

    @property
    def real_columns(self) -> tuple[str, ...]:
        """Every real user column a file must hold: observed, known, static."""
        return self.schema().user(Role.OBSERVED, Role.KNOWN, Role.STATIC, kind=Kind.REAL)

    @property
    def series_reals(self) -> tuple[str, ...]:
        """The real user columns sent per bar (the wire's user_features): observed, then known."""
        return self.schema().user(Role.OBSERVED, Role.KNOWN, kind=Kind.REAL)

    @property
    def series_categoricals(self) -> tuple[str, ...]:
        """The categorical user columns sent per bar: observed, then known."""
        return self.schema().user(Role.OBSERVED, Role.KNOWN, kind=Kind.CATEGORICAL)

    @property
    def has_user_inputs(self) -> bool:
        """Whether any user column beyond observed reals is used (known, static or categorical)."""
        return bool(self.known_columns or self.static_columns or self.categorical_columns)

    def vocabulary(self, name: str) -> tuple[str, ...]:
        return dict(self.vocabularies)[name]

    def hours_of(self, series: np.ndarray | None) -> np.ndarray | None:
        """The trading hours of each of `series` [B] (names), "" for one without; None when none has hours."""
        if not self.trading_hours or series is None:
            return None
        hours = dict(self.trading_hours)
        names = np.asarray(series)
        return np.array([hours.get(str(name), "") for name in names.reshape(-1)]).reshape(names.shape)

    @property
    def contract_known(self) -> tuple[str, ...]:
        """The built-in known contract features: CONTRACT_KNOWN for a `calendar:N` roll, else none."""
        rolls_by_calendar = self.contracts is not None and roll_sessions(self.contracts.roll) is not None
        return CONTRACT_KNOWN if rolls_by_calendar else ()

    def schema(self) -> FeatureSchema:
        """The model's variables of each role, in the column order of every array: the one description of roles."""
        return self._schema

    @functools.cached_property
    def _schema(self) -> FeatureSchema:
        """Static: the symbol, user categoricals, user reals. Observed and known: built-in, then user reals, then
        user categoricals."""
        cat, real = Kind.CATEGORICAL, Kind.REAL

        def user(names: tuple[str, ...], role: Role, kinds: tuple[Kind, Kind]) -> list[FeatureSpec]:
            return [FeatureSpec(n, role, k, source="user") for k in kinds for n in names
                    if (n in self.categorical_columns) == (k == cat)]

        return FeatureSchema((
            FeatureSpec(STATIC_SYMBOL, Role.STATIC, cat), *user(self.static_columns, Role.STATIC, (cat, real)),
            *(FeatureSpec(n, Role.OBSERVED, real) for n in BUILTIN_OBSERVED),
            *user(self.user_columns, Role.OBSERVED, (real, cat)),
            *(FeatureSpec(n, Role.KNOWN, real) for n in BUILTIN_KNOWN + self.contract_known),
            *user(self.known_columns, Role.KNOWN, (real, cat))))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"horizon": self.horizon, "volatility_window": self.volatility_window,
                             "user_columns": list(self.user_columns), "calendar_tz": self.calendar_tz}
        if self.has_user_inputs:  # a model without them keeps the same metadata
            d |= {"known_columns": list(self.known_columns), "static_columns": list(self.static_columns),
                  "categorical_columns": list(self.categorical_columns),
                  "vocabularies": {name: list(v) for name, v in self.vocabularies}}
        if self.contracts is not None:
            d["contracts"] = self.contracts.to_dict()
        if self.trading_hours:
            d["trading_hours"] = dict(self.trading_hours)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> FeatureConfig:
        return FeatureConfig(int(d["horizon"]), int(d["volatility_window"]), tuple(d["user_columns"]),
                             str(d["calendar_tz"]), tuple(d.get("known_columns", ())),
                             tuple(d.get("static_columns", ())), tuple(d.get("categorical_columns", ())),
                             tuple((name, tuple(v)) for name, v in d.get("vocabularies", {}).items()),
                             ContractConfig.from_dict(d["contracts"]) if d.get("contracts") else None,
                             tuple(d.get("trading_hours", {}).items()))


ROLE_FLAGS = {"user_columns": "--features", "known_columns": "--known-features", "static_columns": "--static-features"}


def check_roles(config: FeatureConfig) -> None:
    """ValueError for a user column in two roles, or a categorical column in none."""
    seen: dict[str, str] = {}
    for field_name, flag in ROLE_FLAGS.items():
        for name in getattr(config, field_name):
            if name in seen and seen[name] != flag:
                raise ValueError(f"user feature {name!r} is given to {seen[name]} and {flag}: a column has one "
                                 "role; keep it in one of them")
            seen[name] = flag
    if stray := [c for c in config.categorical_columns if c not in seen]:
        raise ValueError(f"--categorical-features {', '.join(stray)}: not given a role; add each to --features, "
                         "--known-features or --static-features too")
    if config.vocabularies and (lacking := [c for c in config.categorical_columns
                                            if c not in dict(config.vocabularies)]):
        raise ValueError(f"no vocabulary for categorical feature(s) {', '.join(lacking)}")
