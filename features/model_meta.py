"""The ONNX model's `metadata_props`: what the server needs, written by export (strings; JSON values).

Torch-free, so the server reads and checks a model file without importing torch.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from features.bars import ColumnMap
from features.config import FeatureConfig
from features.contracts import ContractConfig
from features.schema import FeatureSchema

FORMAT = "foxhunt-tft-onnx/1"
PREFIX = "foxhunt."
TRAINING_KEYS = ("first_bar_ns", "validation_from_ns", "test_from_ns", "last_bar_ns")  # ModelMeta.training
METADATA_PROPS_FIELD = 14  # ModelProto.metadata_props, in onnx.proto


class ModelMetaError(ValueError):
    """An ONNX model whose metadata is missing or inconsistent; the server refuses it."""


def graph_digest(model_bytes: bytes) -> str:
    """sha256 of a serialized ONNX model without its `metadata_props`, as the file stores it. Export records
    it; a loader that computes another knows the graph changed after the checks. ValueError for non-protobuf."""
    data = memoryview(model_bytes)
    digest = hashlib.sha256()
    for number, start, _, end in _fields(data):
        if number != METADATA_PROPS_FIELD:
            digest.update(data[start:end])
    return digest.hexdigest()


def stored_props(model_bytes: bytes) -> dict[str, str]:
    """The model's `metadata_props`, read without a session; ValueError for bytes that are not protobuf."""
    data = memoryview(model_bytes)
    props = {}
    for number, _, payload, end in _fields(data):
        if number == METADATA_PROPS_FIELD:  # StringStringEntryProto: key = 1, value = 2
            record = data[payload:end]
            try:
                entry = {n: bytes(record[p:e]).decode("utf-8") for n, _, p, e in _fields(record) if n in (1, 2)}
            except UnicodeDecodeError:  # protobuf strings are UTF-8: a byte of this one was damaged
                if PREFIX.encode() not in bytes(record):
                    continue  # not ours: ONNX Runtime's error says what the file is
                raise ModelMetaError(f"a metadata record at byte {payload} is not UTF-8 text: the file was damaged "
                                     "after export; copy it again, or re-export the model") from None
            props[entry.get(1, "")] = entry.get(2, "")
    return props


def _fields(data: memoryview) -> Iterator[tuple[int, int, int, int]]:
    """Top-level protobuf fields: (number, start of key, start of payload, end)."""
    i, n = 0, len(data)
    while i < n:
        start = i
        key, i = _varint(data, i)
        wire, payload = key & 7, i
        if wire == 0:
            i = _varint(data, i)[1]
        elif wire == 1:
            i += 8
        elif wire == 2:
            length, payload = _varint(data, i)
            i = payload + length
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {start}: not an ONNX model")
        if i > n:
            raise ValueError(f"a field at byte {start} runs past the end of the file: truncated")
        yield key >> 3, start, payload, i


def _varint(data: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError(f"a malformed varint at byte {i}: not an ONNX model")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


@dataclass(frozen=True)
class ModelMeta:
    model_config: dict[str, Any]  # trainer ModelConfig as a dict
    feature_config: FeatureConfig
    feature_schema: FeatureSchema
    quantiles: tuple[float, ...]
    horizon: int
    encoder_length: int
    bar_interval_ns: int
    symbols: tuple[str, ...]
    checkpoint_sha256: str
    model_version: str  # a short id: the checkpoint hash's first 12 hex digits, -fp16, -noexplain as exported
    explain: bool  # the model also returns attention and variable-selection weights
    precision: str  # fp32 | fp16 (inputs and outputs are float32 either way)
    column_map: dict[str, str] = field(default_factory=dict)
    exporter: dict[str, Any] = field(default_factory=dict)  # library versions, opset
    parity: dict[str, Any] = field(default_factory=dict)  # the parity report export proved
    placement: dict[str, Any] = field(default_factory=dict)  # the placement gate's report
    training: dict[str, Any] = field(default_factory=dict)  # the training run's bars in time (training_span)
    graph_sha256: str = ""  # graph_digest of the model file as exported
    calibration: dict[str, Any] | None = None  # export.calibrate's offsets [H][Q] and coverage; None: uncalibrated
    # the training split's NormStats.to_dict of each input block (observed, known, static); {}: exported without
    input_stats: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def symbol_index(self) -> dict[str, int]:
        """Symbol -> its id, the static input."""
        return {s: i for i, s in enumerate(self.symbols)}

    @property
    def contracts(self) -> ContractConfig | None:
        """How the model's training bars were rolled from futures contracts into its roots; None: plain series."""
        return self.feature_config.contracts

    def root_of(self, name: str) -> str | None:
        """The model symbol a request's `name` forecasts: the name itself when the model knows it, else (a model of
        futures roots) the root of a contract name, when the model knows that root; None otherwise."""
        if name in self.symbol_index:
            return name
        root = self.contracts.root_of(name) if self.contracts is not None else None
        return root if root in self.symbol_index else None

    @property
    def bars_required(self) -> int:
        """Bars per series a request must carry: the features' warm-up plus the encoder."""
        return self.feature_config.warmup_bars + self.encoder_length

    def to_props(self) -> dict[str, str]:
        values: dict[str, Any] = {"format": FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)},
                                  "feature_config": self.feature_config.to_dict(),
                                  "feature_schema": self.feature_schema.to_list(), "bars_required": self.bars_required}
        if self.calibration is None:
            del values["calibration"]
        if not self.input_stats:
            del values["input_stats"]
        return {PREFIX + k: v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}

    @staticmethod
    def from_props(props: dict[str, str]) -> ModelMeta:
        """Parse and check; ModelMetaError names the first missing or bad key."""
        if props.get(PREFIX + "format") != FORMAT:
            raise ModelMetaError(f"not a foxhunt-tft model: metadata '{PREFIX}format' is "
                                 f"{props.get(PREFIX + 'format')!r}, expected {FORMAT}. Export it with "
                                 "`python -m export ckpt.pt model.onnx`")
        try:
            meta = _parse(props)
        except ModelMetaError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelMetaError(f"model metadata is inconsistent: {exc}") from None
        if re.fullmatch(r"[0-9a-f]{64}", meta.graph_sha256) is None:
            raise ModelMetaError(f"model metadata '{PREFIX}graph_sha256' is not a sha256 (64 hex digits): the file "
                                 "was damaged or edited after export; re-export the model")
        meta.check()
        return meta

    def check(self) -> None:
        problems = []
        if self.horizon != self.feature_config.horizon:
            problems.append(f"horizon {self.horizon} != feature_config.horizon {self.feature_config.horizon}")
        if self.horizon < 1 or self.encoder_length < 1:
            problems.append("horizon and encoder_length must be >= 1")
        q = list(self.quantiles)
        if not q or any(not 0.0 < x < 1.0 for x in q) or any(b <= a for a, b in itertools.pairwise(q)):
            problems.append(f"quantiles must be a non-empty list of strictly increasing levels in (0, 1), not {q}")
        if not self.symbols:
            problems.append("symbol vocabulary is empty")
        elif len(set(self.symbols)) != len(self.symbols):
            problems.append("symbols must be unique: the vocabulary has duplicates")
        elif not all(self.symbols):  # a request names its series: "" is no name (the bars refuse it too)
            problems.append("symbols must be non-empty names: the training bars named a series ''; retrain with "
                            "every series named")
        if self.bar_interval_ns <= 0:
            problems.append("bar_interval_ns must be > 0")
        if (computed := self.feature_config.schema()).to_list() != self.feature_schema.to_list():
            problems.append((f"feature_schema's user columns {self.feature_schema.user_columns} are not those "
                             f"feature_config computes ({computed.user_columns})" if computed.user_columns !=
                             self.feature_schema.user_columns else "feature_schema is not what feature_config "
                             "computes") + " (edited after export?); re-export the model")
        if self.precision not in ("fp32", "fp16"):
            problems.append(f"precision {self.precision!r} is not fp32 or fp16")
        try:
            ColumnMap.from_dict(self.column_map)
        except (TypeError, ValueError) as exc:
            problems.append(f"column_map: {exc}")
        if not _span_ok(self.training):
            problems.append(f"training must map {', '.join(TRAINING_KEYS)} to int64 nanoseconds (or null; "
                            f"validation_from_ns set) in time order, not {self.training!r}")
        if self.calibration is not None and not _offsets_ok(self.calibration.get("offsets"), self.horizon,
                                                            len(self.quantiles)):
            problems.append(f"calibration offsets must be {self.horizon} rows (horizon) of {len(self.quantiles)} "
                            "numbers (quantiles)")
        if problems:
            raise ModelMetaError("model metadata is inconsistent: " + "; ".join(problems))


def _value(props: dict[str, str], key: str, json_value: bool = True) -> Any:
    if PREFIX + key not in props:
        raise ModelMetaError(f"model metadata lacks '{PREFIX}{key}'; re-export the model")
    raw = props[PREFIX + key]
    try:
        return json.loads(raw) if json_value else raw
    except json.JSONDecodeError:
        raise ModelMetaError(f"model metadata '{PREFIX}{key}' is not valid JSON") from None


_FROM_JSON: dict[str, Callable[[Any], Any]] = {  # each field's value from its JSON; the fields not named are text
    "model_config": dict, "feature_config": FeatureConfig.from_dict, "feature_schema": FeatureSchema.from_list,
    "quantiles": lambda v: tuple(float(q) for q in v), "horizon": int, "encoder_length": int, "bar_interval_ns": int,
    "symbols": lambda v: tuple(str(s) for s in v), "explain": bool, "column_map": dict, "exporter": dict,
    "parity": dict, "placement": dict, "training": dict, "calibration": dict, "input_stats": dict,
}


def _parse(props: dict[str, str]) -> ModelMeta:
    training = _value(props, "training")
    if not isinstance(training, dict):
        raise ModelMetaError(f"model metadata '{PREFIX}training' must be a JSON object of "
                             f"{', '.join(TRAINING_KEYS)}, not {type(training).__name__}; re-export the model")
    values: dict[str, Any] = {}
    for f in fields(ModelMeta):
        if f.name in ("calibration", "input_stats") and PREFIX + f.name not in props:
            continue  # exported without them: the defaults
        parse = _FROM_JSON.get(f.name)
        values[f.name] = parse(_value(props, f.name)) if parse else str(_value(props, f.name, json_value=False))
    return ModelMeta(**values)


def _offsets_ok(offsets: Any, horizon: int, n_quantiles: int) -> bool:
    """A list of `horizon` lists of `n_quantiles` numbers."""
    return (isinstance(offsets, list) and len(offsets) == horizon
            and all(isinstance(row, list) and len(row) == n_quantiles
                    and all(isinstance(x, int | float) for x in row) for row in offsets))


def _span_ok(training: dict[str, Any]) -> bool:
    """The four keys, each an int64 or null, validation_from_ns set, in time order."""
    if set(training) != set(TRAINING_KEYS) or training["validation_from_ns"] is None:
        return False
    if any(v is not None and (type(v) is not int or not -(2**63) <= v < 2**63) for v in training.values()):
        return False
    first, val, test, last = (training[k] for k in TRAINING_KEYS)
    times = [t for t in (first, val, test) if t is not None]
    return times == sorted(times) and (last is None or last + 1 >= times[-1])


def training_span(ckpt: dict[str, Any]) -> dict[str, Any]:
    """When the checkpoint's run trained, validated and tested, as UTC nanoseconds (TRAINING_KEYS)."""
    val_from, test_from = (int(t) for t in ckpt["split_times_ns"])
    first, last = (int(t) for t in ckpt["data_span_ns"])
    tested = float(ckpt["train_config"]["test_fraction"]) > 0
    return {"first_bar_ns": first, "validation_from_ns": val_from, "test_from_ns": test_from if tested else None,
            "last_bar_ns": last}
