"""The TFT's architecture configuration: a frozen dataclass saved as a plain dict."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    n_observed: int  # real variables known only up to the last bar (encoder only)
    n_known: int  # real variables known for every bar, past and future (encoder and decoder)
    static_cardinalities: tuple[int, ...]  # vocabulary size of each static categorical, e.g. (n_symbols,)
    hidden_size: int = 64  # width of every block (d_model)
    attention_heads: int = 4  # heads of the interpretable attention; must divide hidden_size
    dropout: float = 0.1  # dropout rate inside GRNs, gates and attention
    lstm_layers: int = 1  # stacked layers of the encoder and of the decoder LSTM
    encoder_length: int = 60  # L: past bars the model reads
    horizon: int = 5  # H: future bars it forecasts
    quantiles: tuple[float, ...] = (0.1, 0.5, 0.9)  # predicted quantile levels, strictly increasing
    variable_hidden_size: int = 0  # per-variable embedding size inside variable selection; 0 = hidden_size

    def __post_init__(self) -> None:
        # accept lists (e.g. from JSON) but store tuples, so the config stays hashable
        object.__setattr__(self, "static_cardinalities", tuple(int(c) for c in self.static_cardinalities))
        object.__setattr__(self, "quantiles", tuple(float(q) for q in self.quantiles))
        self.validate()

    # ---- derived sizes ------------------------------------------------------------------
    @property
    def n_quantiles(self) -> int:
        return len(self.quantiles)

    @property
    def n_static(self) -> int:
        return len(self.static_cardinalities)

    @property
    def n_encoder_vars(self) -> int:
        return self.n_observed + self.n_known

    @property
    def var_hidden(self) -> int:
        return self.variable_hidden_size or self.hidden_size

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.attention_heads

    # ---- checks and (de)serialisation ---------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first field that makes no sense."""
        positive = {
            "n_known": self.n_known,
            "hidden_size": self.hidden_size,
            "attention_heads": self.attention_heads,
            "lstm_layers": self.lstm_layers,
            "encoder_length": self.encoder_length,
            "horizon": self.horizon,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {value}")
        if self.n_observed < 0:
            raise ValueError(f"ModelConfig.n_observed must be >= 0, got {self.n_observed}")
        if self.variable_hidden_size < 0:
            raise ValueError(f"ModelConfig.variable_hidden_size must be >= 0, got {self.variable_hidden_size}")
        if not self.static_cardinalities or min(self.static_cardinalities) < 1:
            raise ValueError(
                "ModelConfig.static_cardinalities needs at least one static categorical, each with a "
                f"vocabulary of >= 1, got {self.static_cardinalities}"
            )
        if self.hidden_size % self.attention_heads:
            raise ValueError(
                f"ModelConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"attention_heads ({self.attention_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")
        qs = self.quantiles
        if not qs or any(not 0.0 < q < 1.0 for q in qs) or any(b <= a for a, b in itertools.pairwise(qs)):
            raise ValueError(f"ModelConfig.quantiles must be non-empty, strictly increasing, in (0, 1); got {qs}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["static_cardinalities"] = list(self.static_cardinalities)
        d["quantiles"] = list(self.quantiles)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"ModelConfig.from_dict: unknown keys {unknown}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(d))
        if missing:
            raise ValueError(f"ModelConfig.from_dict: missing keys {missing}")
        return cls(**d)
