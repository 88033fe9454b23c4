"""The TFT's architecture configuration: a frozen dataclass saved as a plain dict."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

QUANTILE_SCALES = ("volatility", "fixed")
CALENDAR_COLUMNS = 4  # the known reals a seasonal scale reads: tod_sin, tod_cos, dow_sin, dow_cos (BUILTIN_KNOWN)
MINIMUMS = {"n_known": 1, "hidden_size": 1, "attention_heads": 1, "lstm_layers": 1, "encoder_length": 1, "horizon": 1,
            "n_observed": 0, "variable_hidden_size": 0}  # the least value of each count


@dataclass(frozen=True)
class ModelConfig:
    n_observed: int  # variables known only up to the last bar (encoder only): reals, then categoricals
    n_known: int  # variables known for every bar, past and future (encoder and decoder): reals, then categoricals
    static_cardinalities: tuple[int, ...]  # vocabulary size of each static categorical, e.g. (n_symbols,)
    hidden_size: int = 64  # width of every block (d_model)
    attention_heads: int = 4  # heads of the interpretable attention; must divide hidden_size
    dropout: float = 0.1  # dropout rate inside GRNs, gates and attention
    lstm_layers: int = 1  # stacked layers of the encoder and of the decoder LSTM
    encoder_length: int = 60  # L: past bars the model reads
    horizon: int = 5  # H: future bars it forecasts
    quantiles: tuple[float, ...] = (0.1, 0.5, 0.9)  # predicted quantile levels, strictly increasing
    variable_hidden_size: int = 0  # per-variable embedding size inside variable selection; 0 = hidden_size
    quantile_scale: str = "volatility"  # volatility: quantiles in units of the encoder's trailing volatility; fixed
    observed_cardinalities: tuple[int, ...] = ()  # embedding rows of each observed categorical (the last columns)
    known_cardinalities: tuple[int, ...] = ()  # embedding rows of each known categorical (the last columns)
    n_static_real: int = 0  # static real variables (the static_real input)
    seasonal_scale: bool = False  # volatility scale of a seasonal GARCH (modeling._seasonal_scale); False: the EWMA

    def __post_init__(self) -> None:
        # accept lists (e.g. from JSON) but store tuples, so the config stays hashable
        for name in ("static_cardinalities", "observed_cardinalities", "known_cardinalities"):
            object.__setattr__(self, name, tuple(int(c) for c in getattr(self, name)))
        object.__setattr__(self, "quantiles", tuple(float(q) for q in self.quantiles))
        check_fields(vars(self), lambda name: f"ModelConfig.{name}")  # ValueError naming the first bad field
        if self.seasonal_scale and (self.quantile_scale != "volatility" or self.n_known_real < CALENDAR_COLUMNS):
            raise ValueError("ModelConfig.seasonal_scale needs quantile_scale 'volatility' and the calendar's "
                             f"{CALENDAR_COLUMNS} known reals first, got {self.quantile_scale!r} and "
                             f"{self.n_known_real} known reals")

    @property
    def n_quantiles(self) -> int:
        return len(self.quantiles)

    @property
    def n_static(self) -> int:
        return len(self.static_cardinalities)

    @property
    def n_static_vars(self) -> int:
        return self.n_static + self.n_static_real

    @property
    def n_observed_real(self) -> int:
        return self.n_observed - len(self.observed_cardinalities)

    @property
    def n_known_real(self) -> int:
        return self.n_known - len(self.known_cardinalities)

    @property
    def n_encoder_vars(self) -> int:
        return self.n_observed + self.n_known

    @property
    def var_hidden(self) -> int:
        return self.variable_hidden_size or self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        try:
            return cls(**d)
        except TypeError as exc:  # an unknown or a missing key
            raise ValueError(f"ModelConfig.from_dict: {exc}") from None


def check_fields(values: Mapping[str, Any], label: Callable[[str], str]) -> None:
    """ModelConfig's rules on `values` (its fields by name); ValueError naming the first field that breaks one as
    `label(name)` says it: `ModelConfig.hidden_size` here, the flag `--hidden-size` for the trainer's command."""
    for name, least in MINIMUMS.items():
        if values[name] < least:
            raise ValueError(f"{label(name)} must be >= {least}, got {values[name]}")
    cards = tuple(values["static_cardinalities"])
    if not cards or min(cards) < 1:
        raise ValueError(f"{label('static_cardinalities')} needs at least one static categorical, each with a "
                         f"vocabulary of >= 1, got {cards}")
    # observed categoricals follow at least one real (log_return, which the volatility scale reads)
    limits = (("observed_cardinalities", values["n_observed"] - 1), ("known_cardinalities", values["n_known"]))
    for name, most in limits:
        cards = tuple(values.get(name, ()))
        if len(cards) > most or (cards and min(cards) < 1):
            raise ValueError(f"{label(name)} must give a vocabulary of >= 1 for each of at most {most} variables, "
                             f"got {cards}")
    if values.get("n_static_real", 0) < 0:
        raise ValueError(f"{label('n_static_real')} must be >= 0, got {values['n_static_real']}")
    if values["hidden_size"] % values["attention_heads"]:
        raise ValueError(f"{label('hidden_size')} {values['hidden_size']} must be divisible by "
                         f"{label('attention_heads')} {values['attention_heads']}")
    if not 0.0 <= values["dropout"] < 1.0:
        raise ValueError(f"{label('dropout')} must be in [0, 1), got {values['dropout']}")
    if values["quantile_scale"] not in QUANTILE_SCALES:
        raise ValueError(f"{label('quantile_scale')} must be {' or '.join(QUANTILE_SCALES)}, got "
                         f"{values['quantile_scale']!r}")
    qs = tuple(values["quantiles"])
    if not qs or any(not 0.0 < q < 1.0 for q in qs) or any(b <= a for a, b in itertools.pairwise(qs)):
        raise ValueError(f"{label('quantiles')} must be non-empty, strictly increasing, in (0, 1); got "
                         f"{', '.join(f'{q:g}' for q in qs) or 'none'}")
