"""The trainer's configuration: one frozen dataclass, a TOML file, and a flag per field.
Precedence: defaults < config file (`--config cfg.toml`) < flags."""

from __future__ import annotations

import argparse
import inspect
import re
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from features.calendar import check_time_zone
from features.categories import cardinality
from features.config import BUILTIN_KNOWN, BUILTIN_OBSERVED, CONTRACT_KNOWN, STATIC_SYMBOL, FeatureConfig
from features.contracts import ROLL_RULES, ContractFlags, add_arguments, roll_sessions
from features.exchanges import EXCHANGE_ZONE
from features.schema import Role
from trainer.model_config import ModelConfig, check_fields


class ConfigError(ValueError):
    """A config file or flag that cannot be used; the message says what to change."""


FEATURE_LISTS = ("features", "known_features", "static_features", "categorical_features")  # user column names
STOPPING_RULES = ("epochs", "patience")  # when a run stops: a resumed run takes them when given, else its own
# a user column of one of these names is refused
BUILTIN_NAMES = (STATIC_SYMBOL, *BUILTIN_OBSERVED, *BUILTIN_KNOWN, *CONTRACT_KNOWN)
# What a resumed run takes from its command; everything else is the run's recipe, kept as its checkpoint holds it
RESUME_OVERRIDABLE = (*STOPPING_RULES, "device", "vram_budget", "threads", "grad_checkpointing", "precision")
MINIMUMS = {"encoder_length": 1, "horizon": 1, "volatility_window": 2, "epochs": 1, "batch_size": 1, "window_block": 0,
            "weight_decay": 0, "warmup_steps": 0, "grad_clip": 0, "max_steps_per_epoch": 0, "max_val_windows": 0,
            "threads": 0, "patience": 0}  # the least value of each numeric field ModelConfig does not check
AUTO_WINDOW_BLOCK = 16  # window_block 0: blocks of 16 consecutive windows ...
MIN_BLOCKS_PER_BATCH = 8  # ... but at least 8 blocks in a batch
# The contract fields and their flags' argparse names (features.contracts.add_arguments); None: not given
CONTRACT_FIELDS = {"contract_col": "contract_col", "roots": "roots", "roll": "roll", "adjust": "adjust",
                   "volume": "volume_mode", "expiration_col": "expiration_col"}
BOOL_WORDS = {"true": True, "on": True, "yes": True, "1": True, "false": False, "off": False, "no": False, "0": False}


@dataclass(frozen=True)
class TrainConfig:
    # ---- data ----
    encoder_length: int = 60  # past bars the encoder sees (L)
    horizon: int = 5  # future bars forecast (H)
    volatility_window: int = 20  # bars in the rolling-volatility feature
    features: tuple[str, ...] = ()  # extra parquet columns used as observed features (known up to the last bar)
    known_features: tuple[str, ...] = ()  # parquet columns known for future bars too (e.g. a scheduled release)
    static_features: tuple[str, ...] = ()  # parquet columns constant within a symbol (e.g. its exchange)
    categorical_features: tuple[str, ...] = ()  # which user columns, of any role, are categories (text or integers)
    calendar_tz: str = EXCHANGE_ZONE  # calendar features' zone, e.g. America/Chicago; exchange: most roots' exchange's
    val_fraction: float = 0.15  # last share of the bars (distinct timestamps) used for validation
    test_fraction: float = 0.0  # share of the bars after validation held out as a test split (0 = none)
    # ---- futures contracts (features.contracts; None: not given, the bars' names decide) ----
    contract_col: str | None = None  # column of raw contract names (None: the symbol column)
    roots: str | None = None  # contract -> root: a CSV file contract,root[,expiration] or a bars column
    roll: str | None = None  # volume | calendar:N | none (None: volume for contract names, else plain series)
    adjust: str | None = None  # none | ratio: the continuous series' price levels (None: none)
    volume: str | None = None  # front | root: a continuous bar's volume (None: front)
    expiration_col: str | None = None  # column of contract expirations for calendar:N (None: expiration)
    # ---- model ----
    hidden_size: int = 64  # width of every TFT layer (d_model)
    attention_heads: int = 4  # heads of the interpretable attention
    dropout: float = 0.1  # dropout inside gated residual networks and attention
    lstm_layers: int = 1  # layers of the LSTM encoder and decoder
    variable_hidden_size: int = 0  # per-variable embedding width in variable selection (0 = hidden_size)
    quantiles: tuple[float, ...] = (0.1, 0.5, 0.9)  # forecast quantile levels, increasing
    quantile_scale: str = "volatility"  # volatility: relative to the encoder bars' volatility | fixed: one scale
    seasonal_scale: bool = True  # scale as a seasonal GARCH: time-of-day profile, long-run level, ranges (false: EWMA)
    # ---- optimisation ----
    epochs: int = 10  # maximum epochs
    batch_size: int = 256  # effective batch (windows per optimizer step)
    learning_rate: float = 1e-3  # AdamW peak learning rate
    weight_decay: float = 1e-4  # AdamW weight decay
    warmup_steps: int = 50  # linear warm-up steps before cosine decay
    grad_clip: float = 1.0  # max gradient norm (0 = no clipping)
    patience: int = 3  # epochs without validation improvement before stopping (0 = never stop early)
    max_steps_per_epoch: int = 0  # cap on optimizer steps per epoch, windows sampled at random (0 = all)
    window_block: int = 0  # consecutive windows shuffled as one block, their shared bars selected once (0 = auto)
    max_val_windows: int = 0  # cap on validation windows, evenly spaced (0 = all)
    seed: int = 7  # seeds weights, shuffling and dropout
    # ---- device ----
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto (bf16/fp16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16
    vram_budget: str = ""  # e.g. "4GiB": cap on peak device memory (CUDA only)
    grad_checkpointing: str = "auto"  # auto | on | off
    threads: int = 0  # CPU threads for torch (0 = torch's default)

    def validate(self, label: Callable[[str], str] = str) -> None:
        """ConfigError naming the first bad field as `label(name)` says it (flag or --config key), with its value."""
        for ok, message in self._checks(label):
            if not ok:
                raise ConfigError(message)
        try:
            check_fields({**self._model_fields(), "n_observed": 1, "n_known": 1, "static_cardinalities": (1,)}, label)
            if self.calendar_tz != EXCHANGE_ZONE:
                check_time_zone(self.calendar_tz)
            self.feature_config()  # a column in two roles, a categorical column in none
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _checks(self, key: Callable[[str], str]) -> list[tuple[bool, str]]:
        """(holds, message) for each rule of the fields ModelConfig does not check."""
        return [
            *((getattr(self, name) >= least, f"{key(name)} must be >= {least}, got {getattr(self, name)}")
              for name, least in MINIMUMS.items()),
            (0.0 < self.val_fraction < 1.0, f"{key('val_fraction')} must be between 0 and 1, got {self.val_fraction}"),
            (0.0 <= self.test_fraction < 1.0 - self.val_fraction, f"{key('test_fraction')} must be >= 0 and leave "
             f"room for training ({key('val_fraction')} + {key('test_fraction')} < 1), got {self.test_fraction} with "
             f"{self.val_fraction}"),
            (self.learning_rate > 0, f"{key('learning_rate')} must be > 0, got {self.learning_rate}"),
            *(check for name in FEATURE_LISTS for check in self._name_checks(name, key)),
            (self.precision in ("auto", "fp32", "bf16", "fp16"),
             f"{key('precision')} must be auto, fp32, bf16 or fp16, got {self.precision!r}"),
            (self.grad_checkpointing in ("auto", "on", "off"),
             f"{key('grad_checkpointing')} must be auto, on or off, got {self.grad_checkpointing!r}"),
            (self.roll in (None, "volume", "none") or roll_sessions(str(self.roll)) is not None,
             f"{key('roll')} must be {ROLL_RULES}, got {self.roll!r}"),
            (self.adjust in (None, "none", "ratio"), f"{key('adjust')} must be none or ratio, got {self.adjust!r}"),
            (self.volume in (None, "front", "root"), f"{key('volume')} must be front or root, got {self.volume!r}"),
            (re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
             f"{key('device')} must be auto, cpu, cuda or cuda:N, got {self.device!r}"),
        ]

    def _name_checks(self, name: str, key: Callable[[str], str]) -> list[tuple[bool, str]]:
        """(holds, message): the feature list `name` names each column once, and no built-in feature."""
        names: tuple[str, ...] = getattr(self, name)
        twice = sorted({f for f in names if names.count(f) > 1})
        builtin = [f for f in names if f in BUILTIN_NAMES]
        return [
            (not twice, f"{key(name)} lists a column more than once ({', '.join(twice)}); name each once"),
            (not builtin, f"{key(name)} names {', '.join(builtin)}, the name of a built-in feature (built in: "
             f"{', '.join(BUILTIN_NAMES)}): the model would hold two features of one name; rename the column, "
             "e.g. in pyarrow"),
        ]

    def feature_config(self) -> FeatureConfig:
        """The features this run computes, before its vocabularies are fitted (and for calendar_tz "exchange" its zone:
        UTC until the bars name their roots); ValueError for a column in two roles or a categorical one in none."""
        tz = "UTC" if self.calendar_tz == EXCHANGE_ZONE else self.calendar_tz
        return FeatureConfig(self.horizon, self.volatility_window, tuple(self.features), tz,
                             tuple(self.known_features), tuple(self.static_features),
                             tuple(self.categorical_features))

    @property
    def contract_flags(self) -> ContractFlags:
        """The run's contract fields as features.contracts reads them (None: not given)."""
        return ContractFlags(**{name: getattr(self, name) for name in CONTRACT_FIELDS})

    def model_config(self, n_observed: int, n_known: int, n_symbols: int,
                     features: FeatureConfig | None = None) -> ModelConfig:
        """The TFT for `n_observed` and `n_known` variables of each role (reals and categoricals) and `n_symbols`
        symbols; `features` (fitted, with vocabularies) sizes the embeddings of the user categoricals."""
        schema = (features or self.feature_config()).schema()
        vocabularies = dict(features.vocabularies) if features is not None else {}

        def rows(names: list[str]) -> tuple[int, ...]:  # embedding rows of each categorical: labels + unknown
            return tuple(cardinality(vocabularies.get(n, ())) for n in names)

        return ModelConfig(
            n_observed=n_observed,
            n_known=n_known,
            static_cardinalities=(n_symbols, *rows(schema.categorical(Role.STATIC)[1:])),  # the symbol, then user
            observed_cardinalities=rows(schema.categorical(Role.OBSERVED)),
            known_cardinalities=rows(schema.categorical(Role.KNOWN)),
            n_static_real=len(schema.static_reals),
            **self._model_fields() | {"seasonal_scale": self.seasonal_scale and self.quantile_scale == "volatility"},
        )

    def _model_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(ModelConfig) if hasattr(self, f.name)}

    def to_dict(self) -> dict[str, Any]:
        """Plain values; a contract field not given is left out (a plain run's dict holds none of them)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()
                if not (k in CONTRACT_FIELDS and v is None)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TrainConfig:
        """A stored config; one stored before seasonal_scale existed keeps the plain volatility scale it trained."""
        return merge(TrainConfig(), {"seasonal_scale": False, **d}, "checkpoint")

    @property
    def block_windows(self) -> int:
        """window_block, or when 0, 16 but at most batch_size / 8 (a batch spans 8 stretches of time), at least 1."""
        return self.window_block or max(1, min(AUTO_WINDOW_BLOCK, self.batch_size // MIN_BLOCKS_PER_BATCH))


def _coerce(name: str, value: Any, default: Any, label: str) -> Any:
    """Convert a TOML or flag value to the field's type, with a clear error naming it as `label`."""
    try:
        if isinstance(default, bool):  # TOML's true/false, or a flag's (also on/off, yes/no, 1/0)
            return value if isinstance(value, bool) else BOOL_WORDS[str(value).strip().lower()]
        fraction = isinstance(default, int) and isinstance(value, float) and not value.is_integer()
        if isinstance(value, bool) or fraction:  # TOML's true/false is not a number (bool is an int in Python)
            raise ValueError
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, tuple):
            raw = value.split(",") if isinstance(value, str) else list(value)
            items = [i for i in (x.strip() if isinstance(x, str) else x for x in raw) if i != ""]
            return tuple(float(i) for i in items) if name == "quantiles" else tuple(str(i) for i in items)
        return str(value)
    except (TypeError, ValueError, KeyError):
        raise ConfigError(f"{label}: cannot use {value!r} (expected {type(default).__name__})") from None


def merge(base: TrainConfig, values: dict[str, Any], origin: str) -> TrainConfig:
    """`base` with `values` applied; unknown keys are an error naming the known ones."""
    known = {f.name: f for f in fields(TrainConfig)}
    if unknown := sorted(set(values) - set(known)):
        raise ConfigError(f"{origin}: unknown config key(s) {', '.join(unknown)}; known keys: {', '.join(known)}")
    where = flag_name if origin == "flags" else (lambda k: f"{k} ({origin})")
    return replace(base, **{k: _coerce(k, v, getattr(base, k), where(k)) for k, v in values.items()})


def load_toml(path: Path) -> dict[str, Any]:
    """A flat TOML table; sections such as [model] or [train] are flattened."""
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except (OSError, ValueError) as exc:  # no such file, a directory, not UTF-8, not TOML
        raise ConfigError(f"--config {path}: cannot read it as TOML ({exc})") from None
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}
    for section, table in ((k, v) if isinstance(v, dict) else ("", {k: v}) for k, v in raw.items()):
        for k, v in table.items():
            if k in flat:  # sections are flattened: one key in two of them would silently lose one value
                raise ConfigError(f"--config {path}: {k!r} is set in {where[k] or 'the top level'} and in "
                                  f"{f'[{section}]' if section else 'the top level'}; set it once")
            flat[k], where[k] = v, f"[{section}]" if section else ""
    return flat


def field_comments() -> dict[str, str]:
    """Each TrainConfig field's trailing comment: the one description, shown by --help too."""
    return dict(re.findall(r"^    (\w+): [^=]+= .+?  # (.+)$", inspect.getsource(TrainConfig), re.M))


def flag_name(field_name: str) -> str:
    return f"--{field_name.replace('_', '-')}"


def flag_dest(field_name: str) -> str:
    """Where argparse puts a field's flag: cfg_hidden_size; a contract field's, as features.contracts names it."""
    return CONTRACT_FIELDS.get(field_name, f"cfg_{field_name}")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field (`--hidden-size 16`), default None: not given; contract fields' are features.contracts'."""
    g = parser.add_argument_group("config fields (each overrides --config; the same names are the TOML keys)")
    comments = field_comments()
    add_arguments(parser)
    for f in [f for f in fields(TrainConfig) if f.name not in CONTRACT_FIELDS]:
        listed = isinstance(f.default, tuple)
        shown = ",".join(str(x) for x in f.default) if isinstance(f.default, tuple) else repr(f.default)
        shown = shown or "none"  # an empty list (--features): not "(default )"
        g.add_argument(flag_name(f.name), dest=f"cfg_{f.name}", default=None,
                       metavar="A,B" if listed else type(f.default).__name__.upper(),
                       help=f"{comments.get(f.name, '')} (default {shown})")


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: value for f in fields(TrainConfig) if (value := getattr(args, flag_dest(f.name), None)) is not None}


def given_fields(args: argparse.Namespace) -> set[str]:
    """The fields this command sets: in its --config file or as flags (the rest are defaults)."""
    return set(_flag_values(args)) | (set(load_toml(Path(args.config))) if getattr(args, "config", None) else set())


def resumed_config(stored: TrainConfig, now: TrainConfig, given: set[str],
                   label: Callable[[str], str] = str) -> TrainConfig:
    """The checkpoint's recipe, this command's hardware and given stopping rules; ConfigError naming recipe changes."""
    changed = [f"{label(k)} {getattr(now, k)!r} (the checkpoint's: {getattr(stored, k)!r})"
               for k in sorted(given - set(RESUME_OVERRIDABLE)) if getattr(now, k) != getattr(stored, k)]
    if changed:
        raise ConfigError(f"--resume continues the run as its checkpoint configured it, but this command changes "
                          f"{'; '.join(changed)}; drop those settings, or start a new run without --resume "
                          f"(a resumed run may change only {', '.join(RESUME_OVERRIDABLE)})")
    hardware = {k: getattr(now, k) for k in RESUME_OVERRIDABLE if k not in STOPPING_RULES}
    stopping = {k: getattr(now if k in given else stored, k) for k in STOPPING_RULES}
    return replace(stored, **hardware, **stopping)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    cfg = TrainConfig()
    if getattr(args, "config", None):
        cfg = merge(cfg, load_toml(Path(args.config)), f"--config {args.config}")
    cfg = merge(cfg, _flag_values(args), "flags")
    cfg.validate(setting_label(args))
    return cfg


def setting_label(args: argparse.Namespace) -> Callable[[str], str]:
    """How a message names a field: its key and file where this command's --config file sets it (and no flag
    does), else its flag, which sets it or would."""
    config = getattr(args, "config", None)
    in_file = set(load_toml(Path(config))) if config else set()

    def label(name: str) -> str:
        flagged = getattr(args, flag_dest(name), None) is not None
        return f"{name} (--config {config})" if name in in_file and not flagged else flag_name(name)
    return label
