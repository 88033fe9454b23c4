from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FeatureRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FEATURE_ROLE_UNSPECIFIED: _ClassVar[FeatureRole]
    FEATURE_ROLE_STATIC: _ClassVar[FeatureRole]
    FEATURE_ROLE_OBSERVED: _ClassVar[FeatureRole]
    FEATURE_ROLE_KNOWN: _ClassVar[FeatureRole]
FEATURE_ROLE_UNSPECIFIED: FeatureRole
FEATURE_ROLE_STATIC: FeatureRole
FEATURE_ROLE_OBSERVED: FeatureRole
FEATURE_ROLE_KNOWN: FeatureRole

class Column(_message.Message):
    __slots__ = ("name", "values")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, name: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class Labels(_message.Message):
    __slots__ = ("name", "values")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., values: _Optional[_Iterable[str]] = ...) -> None: ...

class Series(_message.Message):
    __slots__ = ("symbol", "timestamp_ns", "open", "high", "low", "close", "volume", "user_features", "user_feature_names", "user_features_raw", "future_features", "categorical_features", "future_categorical_features", "static_features", "static_categorical_features", "contracts")
    class StaticFeaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class StaticCategoricalFeaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SYMBOL_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    VOLUME_FIELD_NUMBER: _ClassVar[int]
    USER_FEATURES_FIELD_NUMBER: _ClassVar[int]
    USER_FEATURE_NAMES_FIELD_NUMBER: _ClassVar[int]
    USER_FEATURES_RAW_FIELD_NUMBER: _ClassVar[int]
    FUTURE_FEATURES_FIELD_NUMBER: _ClassVar[int]
    CATEGORICAL_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FUTURE_CATEGORICAL_FEATURES_FIELD_NUMBER: _ClassVar[int]
    STATIC_FEATURES_FIELD_NUMBER: _ClassVar[int]
    STATIC_CATEGORICAL_FEATURES_FIELD_NUMBER: _ClassVar[int]
    CONTRACTS_FIELD_NUMBER: _ClassVar[int]
    symbol: str
    timestamp_ns: _containers.RepeatedScalarFieldContainer[int]
    open: _containers.RepeatedScalarFieldContainer[float]
    high: _containers.RepeatedScalarFieldContainer[float]
    low: _containers.RepeatedScalarFieldContainer[float]
    close: _containers.RepeatedScalarFieldContainer[float]
    volume: _containers.RepeatedScalarFieldContainer[float]
    user_features: _containers.RepeatedCompositeFieldContainer[Column]
    user_feature_names: _containers.RepeatedScalarFieldContainer[str]
    user_features_raw: bytes
    future_features: _containers.RepeatedCompositeFieldContainer[Column]
    categorical_features: _containers.RepeatedCompositeFieldContainer[Labels]
    future_categorical_features: _containers.RepeatedCompositeFieldContainer[Labels]
    static_features: _containers.ScalarMap[str, float]
    static_categorical_features: _containers.ScalarMap[str, str]
    contracts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, symbol: _Optional[str] = ..., timestamp_ns: _Optional[_Iterable[int]] = ..., open: _Optional[_Iterable[float]] = ..., high: _Optional[_Iterable[float]] = ..., low: _Optional[_Iterable[float]] = ..., close: _Optional[_Iterable[float]] = ..., volume: _Optional[_Iterable[float]] = ..., user_features: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., user_feature_names: _Optional[_Iterable[str]] = ..., user_features_raw: _Optional[bytes] = ..., future_features: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., categorical_features: _Optional[_Iterable[_Union[Labels, _Mapping]]] = ..., future_categorical_features: _Optional[_Iterable[_Union[Labels, _Mapping]]] = ..., static_features: _Optional[_Mapping[str, float]] = ..., static_categorical_features: _Optional[_Mapping[str, str]] = ..., contracts: _Optional[_Iterable[str]] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("series", "explain", "request_id")
    SERIES_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    series: _containers.RepeatedCompositeFieldContainer[Series]
    explain: bool
    request_id: str
    def __init__(self, series: _Optional[_Iterable[_Union[Series, _Mapping]]] = ..., explain: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class VariableWeights(_message.Message):
    __slots__ = ("variables", "steps", "weights")
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    variables: _containers.RepeatedScalarFieldContainer[str]
    steps: int
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, variables: _Optional[_Iterable[str]] = ..., steps: _Optional[int] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class Explanation(_message.Message):
    __slots__ = ("attention_rows", "attention_cols", "attention", "attention_timestamp_ns", "static_weights", "encoder_weights", "decoder_weights")
    ATTENTION_ROWS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_COLS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    STATIC_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DECODER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    attention_rows: int
    attention_cols: int
    attention: _containers.RepeatedScalarFieldContainer[float]
    attention_timestamp_ns: _containers.RepeatedScalarFieldContainer[int]
    static_weights: VariableWeights
    encoder_weights: VariableWeights
    decoder_weights: VariableWeights
    def __init__(self, attention_rows: _Optional[int] = ..., attention_cols: _Optional[int] = ..., attention: _Optional[_Iterable[float]] = ..., attention_timestamp_ns: _Optional[_Iterable[int]] = ..., static_weights: _Optional[_Union[VariableWeights, _Mapping]] = ..., encoder_weights: _Optional[_Union[VariableWeights, _Mapping]] = ..., decoder_weights: _Optional[_Union[VariableWeights, _Mapping]] = ...) -> None: ...

class Forecast(_message.Message):
    __slots__ = ("symbol", "last_timestamp_ns", "last_close", "timestamp_ns", "quantile_levels", "horizon", "log_return", "price", "explanation", "model_version", "warnings")
    SYMBOL_FIELD_NUMBER: _ClassVar[int]
    LAST_TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_CLOSE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    QUANTILE_LEVELS_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    LOG_RETURN_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    symbol: str
    last_timestamp_ns: int
    last_close: float
    timestamp_ns: _containers.RepeatedScalarFieldContainer[int]
    quantile_levels: _containers.RepeatedScalarFieldContainer[float]
    horizon: int
    log_return: _containers.RepeatedScalarFieldContainer[float]
    price: _containers.RepeatedScalarFieldContainer[float]
    explanation: Explanation
    model_version: str
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, symbol: _Optional[str] = ..., last_timestamp_ns: _Optional[int] = ..., last_close: _Optional[float] = ..., timestamp_ns: _Optional[_Iterable[int]] = ..., quantile_levels: _Optional[_Iterable[float]] = ..., horizon: _Optional[int] = ..., log_return: _Optional[_Iterable[float]] = ..., price: _Optional[_Iterable[float]] = ..., explanation: _Optional[_Union[Explanation, _Mapping]] = ..., model_version: _Optional[str] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("forecasts", "model_version")
    FORECASTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    forecasts: _containers.RepeatedCompositeFieldContainer[Forecast]
    model_version: str
    def __init__(self, forecasts: _Optional[_Iterable[_Union[Forecast, _Mapping]]] = ..., model_version: _Optional[str] = ...) -> None: ...

class PredictStreamResponse(_message.Message):
    __slots__ = ("request_id", "response", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: PredictResponse
    error: StreamError
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[PredictResponse, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "code_name", "message", "fields")
    CODE_FIELD_NUMBER: _ClassVar[int]
    CODE_NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    code: int
    code_name: str
    message: str
    fields: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, code: _Optional[int] = ..., code_name: _Optional[str] = ..., message: _Optional[str] = ..., fields: _Optional[_Iterable[str]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Feature(_message.Message):
    __slots__ = ("name", "role", "kind", "source", "vocabulary")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: FeatureRole
    kind: str
    source: str
    vocabulary: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[FeatureRole, str]] = ..., kind: _Optional[str] = ..., source: _Optional[str] = ..., vocabulary: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("bars_required", "bar_interval_ns", "encoder_length", "horizon", "quantiles", "features", "symbols", "user_feature_columns", "explain_available", "model_version", "checkpoint_sha256", "model_sha256", "model_path", "loaded_at_unix_ns", "precision", "device_requested", "provider", "providers", "fallback_warning", "max_batch", "max_message_bytes", "max_concurrent", "torch_imported", "server_version", "bar_columns", "calendar_tz", "calibration", "contract_pattern", "roll_rule", "max_text_chars", "max_columns")
    class BarColumnsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BARS_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    BAR_INTERVAL_NS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_LENGTH_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    QUANTILES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SYMBOLS_FIELD_NUMBER: _ClassVar[int]
    USER_FEATURE_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_WARNING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    TORCH_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    BAR_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    CALENDAR_TZ_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_PATTERN_FIELD_NUMBER: _ClassVar[int]
    ROLL_RULE_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    bars_required: int
    bar_interval_ns: int
    encoder_length: int
    horizon: int
    quantiles: _containers.RepeatedScalarFieldContainer[float]
    features: _containers.RepeatedCompositeFieldContainer[Feature]
    symbols: _containers.RepeatedScalarFieldContainer[str]
    user_feature_columns: _containers.RepeatedScalarFieldContainer[str]
    explain_available: bool
    model_version: str
    checkpoint_sha256: str
    model_sha256: str
    model_path: str
    loaded_at_unix_ns: int
    precision: str
    device_requested: str
    provider: str
    providers: _containers.RepeatedScalarFieldContainer[str]
    fallback_warning: str
    max_batch: int
    max_message_bytes: int
    max_concurrent: int
    torch_imported: bool
    server_version: str
    bar_columns: _containers.ScalarMap[str, str]
    calendar_tz: str
    calibration: Calibration
    contract_pattern: str
    roll_rule: str
    max_text_chars: int
    max_columns: int
    def __init__(self, bars_required: _Optional[int] = ..., bar_interval_ns: _Optional[int] = ..., encoder_length: _Optional[int] = ..., horizon: _Optional[int] = ..., quantiles: _Optional[_Iterable[float]] = ..., features: _Optional[_Iterable[_Union[Feature, _Mapping]]] = ..., symbols: _Optional[_Iterable[str]] = ..., user_feature_columns: _Optional[_Iterable[str]] = ..., explain_available: _Optional[bool] = ..., model_version: _Optional[str] = ..., checkpoint_sha256: _Optional[str] = ..., model_sha256: _Optional[str] = ..., model_path: _Optional[str] = ..., loaded_at_unix_ns: _Optional[int] = ..., precision: _Optional[str] = ..., device_requested: _Optional[str] = ..., provider: _Optional[str] = ..., providers: _Optional[_Iterable[str]] = ..., fallback_warning: _Optional[str] = ..., max_batch: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_concurrent: _Optional[int] = ..., torch_imported: _Optional[bool] = ..., server_version: _Optional[str] = ..., bar_columns: _Optional[_Mapping[str, str]] = ..., calendar_tz: _Optional[str] = ..., calibration: _Optional[_Union[Calibration, _Mapping]] = ..., contract_pattern: _Optional[str] = ..., roll_rule: _Optional[str] = ..., max_text_chars: _Optional[int] = ..., max_columns: _Optional[int] = ...) -> None: ...

class Calibration(_message.Message):
    __slots__ = ("method", "validation_windows", "offsets", "coverage_before", "coverage_after", "interval_coverage_before", "interval_coverage_after")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_AFTER_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_COVERAGE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_COVERAGE_AFTER_FIELD_NUMBER: _ClassVar[int]
    method: str
    validation_windows: int
    offsets: _containers.RepeatedScalarFieldContainer[float]
    coverage_before: _containers.RepeatedScalarFieldContainer[float]
    coverage_after: _containers.RepeatedScalarFieldContainer[float]
    interval_coverage_before: float
    interval_coverage_after: float
    def __init__(self, method: _Optional[str] = ..., validation_windows: _Optional[int] = ..., offsets: _Optional[_Iterable[float]] = ..., coverage_before: _Optional[_Iterable[float]] = ..., coverage_after: _Optional[_Iterable[float]] = ..., interval_coverage_before: _Optional[float] = ..., interval_coverage_after: _Optional[float] = ...) -> None: ...
