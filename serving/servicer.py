"""The Forecaster servicer: thin glue from RPCs to the pure functions and the batcher; the `rpc`
decorator maps errors to status codes (serving.errors.status_of), counts and times every answer."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from features import package_version
from features.contracts import CONTRACT_PATTERN
from features.model_meta import ModelMeta
from features.schema import Kind, Role
from serving.batcher import MicroBatcher
from serving.errors import (
    ExplainUnavailable,
    NotReady,
    Overloaded,
    RequestError,
    ResponseTooLarge,
    status_details,
    status_of,
)
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from serving.inference import Result
from serving.limits import MAX_COLUMNS, MAX_TEXT_CHARS
from serving.logs import BurstLog, Schedule
from serving.metrics import Metrics
from serving.model import LoadedModel
from serving.postprocess import build_response
from serving.validation import SeriesColumns, parse_request

log = logging.getLogger("serving")

ROLES = {Role.STATIC: pb.FEATURE_ROLE_STATIC, Role.OBSERVED: pb.FEATURE_ROLE_OBSERVED,
         Role.KNOWN: pb.FEATURE_ROLE_KNOWN}
Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, aio.ServicerContext[Req, Resp]], Awaitable[Resp]]


@dataclass(frozen=True)
class Limits:
    """Server limits reported by GetModelInfo."""

    max_batch: int
    max_message_bytes: int
    max_concurrent: int


class Admission:
    """At most `limit` Predict calls and stream requests in flight; the next is refused, not queued. The first
    refusal after a quiet spell is logged at once, then their count every minute (serving.logs.BurstLog)."""

    def __init__(self, limit: int, metrics: Metrics, schedule: Schedule | None = None) -> None:
        self.limit = limit
        self.active = 0
        self._metrics = metrics
        first = ("overloaded: refusing calls RESOURCE_EXHAUSTED, --max-concurrent %d in flight (a count of them "
                 "follows every %.0f s while it lasts); raise --max-concurrent, add --workers or replicas, or have "
                 "callers back off")
        count = ("overloaded: refused %d more call(s) RESOURCE_EXHAUSTED in the last %.0f s, --max-concurrent %d in "
                 "flight")
        self._refusals = BurstLog(lambda _: log.warning(first, limit, self._refusals.every_s),
                                  lambda n, _: log.warning(count, n, self._refusals.every_s, limit), schedule=schedule)

    def take(self) -> None:
        """A slot, or Overloaded; each take is matched by one give_back."""
        if self.active >= self.limit:
            self._refusals.note("")
            raise Overloaded(f"server busy: {self.limit} Predict calls and stream requests already in flight "
                             f"(--max-concurrent {self.limit}); retry with backoff")
        self.active += 1
        self._metrics.inflight.inc()

    def give_back(self) -> None:
        self.active -= 1
        self._metrics.inflight.dec()


def series_that_fit(response: pb.PredictResponse, limit: int) -> int:
    """How many of the response's forecasts any response within `limit` bytes can hold: its fixed part (the
    model version) plus that many of its largest forecast as sent (tag, length, bytes)."""
    wire = [1 + max(1, (n.bit_length() + 6) // 7) + n for n in (f.ByteSize() for f in response.forecasts)]
    fixed = response.ByteSize() - sum(wire)
    return max(0, limit - fixed) // max(wire) if wire else 0


def caller_gone(context: aio.ServicerContext[Any, Any]) -> bool:
    """The call's deadline has passed (a client's cancel reaches the handler as asyncio.CancelledError)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def rpc(method: str) -> Callable[[Handler[Req, Resp]], Handler[Req, Resp]]:
    """Map errors to status codes, count answers by code, time the handler."""

    def decorate(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
        @functools.wraps(fn)
        async def wrapper(self: ForecasterServicer, request: Req, context: aio.ServicerContext[Req, Resp]) -> Resp:
            start = time.perf_counter()
            code, gone = grpc.StatusCode.OK, False
            details: tuple[tuple[str, str | bytes], ...] = ()
            try:
                response = await fn(self, request, context)
                if caller_gone(context):  # an answer no one waits for
                    raise asyncio.CancelledError
                return response
            except asyncio.CancelledError:  # the client went away or its deadline passed
                code = grpc.StatusCode.DEADLINE_EXCEEDED if caller_gone(context) else grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:  # not kept past here: its traceback holds the request
                code, message = status_of(exc)
                gone = caller_gone(context)  # no status can reach it: nothing is sent
                code = grpc.StatusCode.DEADLINE_EXCEEDED if gone else code
                details = status_details(exc, code, message)
            finally:
                self.metrics.requests.labels(method, code.name).inc()
                self.metrics.latency.labels(method).observe(time.perf_counter() - start)
            del request  # the abort's traceback holds this frame: not the request's bytes with it
            if gone:
                raise asyncio.CancelledError
            await context.abort(code, message, details)  # raises; the server stays up

        return wrapper

    return decorate


Batcher = MicroBatcher[LoadedModel, list[SeriesColumns], Result]
SERVICE = pb.DESCRIPTOR.services_by_name["Forecaster"]


def decode_request(data: bytes) -> pb.PredictRequest:
    """A call's bytes as a PredictRequest; bytes that are not one are the caller's error, INVALID_ARGUMENT."""
    try:
        return pb.PredictRequest.FromString(data)
    except DecodeError as exc:
        raise RequestError(f"the request's {len(data)} bytes are not a {pb.PredictRequest.DESCRIPTOR.full_name} "
                           f"({exc}); send one serialised from {SERVICE.file.name}", "") from None


def add_to_server(servicer: ForecasterServicer, server: aio.Server) -> None:
    """The Forecaster's methods on `server`, as `add_ForecasterServicer_to_server` adds them, except that Predict and
    PredictStream decode the request bytes themselves: bytes that are not a PredictRequest answer INVALID_ARGUMENT."""
    handlers = {
        "Predict": grpc.unary_unary_rpc_method_handler(
            servicer.Predict, response_serializer=pb.PredictResponse.SerializeToString),
        "PredictStream": grpc.stream_stream_rpc_method_handler(
            servicer.PredictStream, response_serializer=pb.PredictStreamResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.ModelInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)  # type: ignore[attr-defined]  # grpc >= 1.65


MAX_REQUEST_ID_CHARS = 1024  # a request_id is echoed in its answer, error answers included: it must stay small


@dataclass
class StreamAnswer:
    """One PredictStream request's answer, on its way to the caller."""

    message: pb.PredictStreamResponse
    code: grpc.StatusCode  # what the caller gets once it is sent
    held: bool  # it holds an admission slot until sent
    start: float  # time.perf_counter() at the request's arrival


class _Stream:
    """One PredictStream's reader: it reads a request once one of `window` slots is free and queues the task
    of its answer (None ends them). It stops when cancelled, or at about `max_age_s` (jittered)."""

    def __init__(self, requests: AsyncIterator[bytes],
                 answer: Callable[[pb.PredictRequest], Awaitable[StreamAnswer]], window: int,
                 max_age_s: float) -> None:
        self.pending: asyncio.Queue[asyncio.Future[StreamAnswer] | None] = asyncio.Queue()
        self.window = asyncio.Semaphore(window)
        self.aged = False
        self.reader = asyncio.ensure_future(self._read(requests, answer))
        self._timer = (asyncio.get_running_loop().call_later(max_age_s * random.uniform(0.8, 1.0), self._age_out)
                       if max_age_s else None)

    async def _read(self, requests: AsyncIterator[bytes],
                    answer: Callable[[pb.PredictRequest], Awaitable[StreamAnswer]]) -> None:
        """Read until the stream ends; a message that is not a PredictRequest stops it with its RequestError."""
        try:  # a slot first, then the next request: a request read is a request answered
            while await self.window.acquire() and (data := await anext(requests, None)) is not None:
                self.pending.put_nowait(asyncio.ensure_future(answer(decode_request(data))))
        finally:
            self.pending.put_nowait(None)

    def _age_out(self) -> None:
        self.aged = True
        self.reader.cancel()

    def close(self) -> list[StreamAnswer]:
        """Stop reading; cancel the answers still running and return the finished ones never sent."""
        if self._timer is not None:
            self._timer.cancel()
        self.reader.cancel()
        if self.reader.done() and not self.reader.cancelled():
            self.reader.exception()  # retrieved: a stream that ended early has already failed for its own reason
        unsent = []
        while not self.pending.empty():
            if (left := self.pending.get_nowait()) is None:
                continue
            if not left.done():
                left.cancel()
            elif not left.cancelled() and left.exception() is None:
                unsent.append(left.result())
        return unsent


class ForecasterServicer(pb_grpc.ForecasterServicer):
    def __init__(self, model: LoadedModel, batcher: Batcher, metrics: Metrics, limits: Limits,
                 stream_max_age_s: float = 0.0) -> None:
        self.model = model  # the model being served: a SIGHUP reload swaps it in one assignment
        self.batcher = batcher
        self.metrics = metrics
        self.limits = limits
        self.admission = Admission(limits.max_concurrent, metrics)
        self.ready = False  # set once the model is warmed up
        self.draining = False  # set on SIGTERM: new calls are refused while in-flight ones finish
        self.stream_readers: set[asyncio.Future[None]] = set()  # one per open PredictStream
        self.stream_max_age_s = stream_max_age_s  # --max-connection-age: a stream stops reading about this old

    @rpc("Predict")
    async def Predict(self, request: bytes, context: aio.ServicerContext[bytes, pb.PredictResponse]
                      ) -> pb.PredictResponse:
        self.admission.take()
        try:
            return await self._predict(decode_request(request), context)
        finally:
            self.admission.give_back()

    async def _predict(self, request: pb.PredictRequest, context: aio.ServicerContext[Any, Any],
                       wrapper_bytes: int = 0) -> pb.PredictResponse:
        """One request's forecasts (a stream's answer adds `wrapper_bytes`); the caller holds its admission slot."""
        if self.draining:
            raise NotReady("the server is shutting down; retry on another replica")
        if not self.ready:
            raise NotReady("the model is warming up; wait for health SERVING")
        model = self.model  # one snapshot for the whole call
        if request.explain and not model.explain_available:
            raise ExplainUnavailable(f"model {model.version} was exported without explain outputs; "
                                     "send explain=false (GetModelInfo.explain_available)")
        steps = self.metrics.steps
        start = time.perf_counter()
        series = parse_request(request, model.meta)
        steps.add("parse", time.perf_counter() - start)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        result = await self.batcher.submit(model, series, len(series), deadline)
        start = time.perf_counter()
        response = build_response(result.prepared, result.outputs, model.meta, model.version, request.explain)
        self.metrics.warned.inc(sum(1 for f in response.forecasts if f.warnings))
        size = response.ByteSize() + wrapper_bytes
        steps.add("response", time.perf_counter() - start)
        if size > self.limits.max_message_bytes:  # else gRPC fails the send with a status the caller can't act on
            raise self._too_large(response, size, wrapper_bytes, request.explain, len(series))
        return response

    def _too_large(self, response: pb.PredictResponse, size: int, wrapper_bytes: int, explain: bool,
                   sent: int) -> ResponseTooLarge:
        limit = self.limits.max_message_bytes
        fits = series_that_fit(response, limit - wrapper_bytes)
        fixes = [f"send at most {fits} series per request"] if 1 <= fits < sent else []
        fixes += ["set explain=false"] if explain else []
        fixes = fixes or ["the server's --max-message-bytes must be raised for one series' answer"]
        return ResponseTooLarge(f"the response would be {size} bytes, over the server's limit of "
                                f"{limit} (--max-message-bytes); {' or '.join(fixes)}")

    async def PredictStream(self, requests: AsyncIterator[bytes],
                            context: aio.ServicerContext[bytes, pb.PredictStreamResponse]) -> None:
        """Each request as Predict answers it, in request order; a failed request's error travels in its answer.
        At most --max-batch requests are read ahead of their answers (then HTTP/2 flow control holds the caller),
        each holding its admission slot until sent. On shutdown or at --max-connection-age the stream stops
        reading, answers what it has read, then ends UNAVAILABLE."""
        if self.draining:
            await self._end_stream(context, "the server is shutting down; open the stream on another replica")
        window = min(self.limits.max_concurrent, self.limits.max_batch)
        stream = _Stream(requests, lambda request: self._stream_answer(request, context), window,
                         self.stream_max_age_s)
        self.stream_readers.add(stream.reader)
        self.metrics.open_streams.inc()
        try:
            if not await self._send_answers(stream, context):
                return
            if stream.reader.cancelled():  # shutdown, or the stream's age
                why = (f"the stream is --max-connection-age ({self.stream_max_age_s:g} s) old" if stream.aged
                       else "the server is shutting down")
                await self._end_stream(context, f"{why}: every request read was answered; open a new stream (it "
                                                "may reach another replica) and resend each request not answered OK")
            try:
                stream.reader.result()  # any failure of the reader but this one goes on up
            except RequestError as exc:  # it stopped at a message that is not a PredictRequest
                code, message = status_of(exc)
                await self._end_stream(context, message, code, status_details(exc, code, message))
        finally:
            self.stream_readers.discard(stream.reader)
            self.metrics.open_streams.dec()
            for answer in stream.close():
                self._settle(answer, context, sent=False)

    async def _send_answers(self, stream: _Stream, context: aio.ServicerContext[Any, Any]) -> bool:
        """Send each answer as it is ready, in request order; False when the caller is gone."""
        while (answering := await stream.pending.get()) is not None:
            answer, sent = await answering, False
            try:
                await context.write(answer.message)
                sent = True
            except Exception:  # the caller is gone (cancelled, past its deadline, disconnected)
                return False
            finally:
                self._settle(answer, context, sent)
            stream.window.release()
        return True

    async def _end_stream(self, context: aio.ServicerContext[Any, Any], message: str,
                          code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                          details: tuple[tuple[str, str | bytes], ...] = ()) -> None:
        self.metrics.requests.labels("PredictStream", code.name).inc()
        await context.abort(code, message, details)

    async def _stream_answer(self, request: pb.PredictRequest, context: aio.ServicerContext[Any, Any]
                             ) -> StreamAnswer:
        """The answer to one request of a stream; `_settle` counts it and gives its slot back."""
        start = time.perf_counter()
        held = False
        try:
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise RequestError(f"request_id is {len(request.request_id)} characters; send at most "
                                   f"{MAX_REQUEST_ID_CHARS} (it is echoed in the answer)", "request_id")
            self.admission.take()
            held = True
            # the answer adds the request_id and the response's tag and length (at most 6 bytes)
            wrapper = pb.PredictStreamResponse(request_id=request.request_id).ByteSize() + 6
            response = await self._predict(request, context, wrapper)
            return StreamAnswer(pb.PredictStreamResponse(request_id=request.request_id, response=response),
                                grpc.StatusCode.OK, held, start)
        except asyncio.CancelledError:
            self._settle(StreamAnswer(pb.PredictStreamResponse(), grpc.StatusCode.CANCELLED, held, start), context,
                         sent=False)
            raise
        except Exception as exc:
            if held:
                self.admission.give_back()
            code, message = status_of(exc)
            echo = request.request_id if len(request.request_id) <= MAX_REQUEST_ID_CHARS else ""
            fields = [f for f, _ in exc.violations] if isinstance(exc, RequestError) else []
            return StreamAnswer(pb.PredictStreamResponse(request_id=echo, error=pb.StreamError(
                code=code.value[0], code_name=code.name, message=message, fields=fields)), code, False, start)

    def _settle(self, answer: StreamAnswer, context: aio.ServicerContext[Any, Any], sent: bool) -> None:
        """Count and time what the caller got for one request (unsent: the deadline or the cancel); free its slot."""
        code = answer.code if sent else (grpc.StatusCode.DEADLINE_EXCEEDED if caller_gone(context)
                                         else grpc.StatusCode.CANCELLED)
        self.metrics.requests.labels("PredictStream", code.name).inc()
        self.metrics.latency.labels("PredictStream").observe(time.perf_counter() - answer.start)
        if answer.held:
            self.admission.give_back()

    def end_streams(self) -> None:
        """Stop reading every open PredictStream: each answers what it has read, then ends UNAVAILABLE."""
        for reader in self.stream_readers:
            reader.cancel()

    @rpc("GetModelInfo")
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: aio.ServicerContext[pb.GetModelInfoRequest, pb.ModelInfo]) -> pb.ModelInfo:
        return model_info(self.model, self.limits)


def model_info(model: LoadedModel, limits: Limits) -> pb.ModelInfo:
    meta, contracts = model.meta, model.meta.contracts
    return pb.ModelInfo(
        bars_required=meta.bars_required, bar_interval_ns=meta.bar_interval_ns, encoder_length=meta.encoder_length,
        horizon=meta.horizon, quantiles=list(meta.quantiles), features=features_info(meta),
        symbols=list(meta.symbols), user_feature_columns=list(meta.feature_config.series_reals),
        explain_available=model.explain_available, model_version=model.version,
        checkpoint_sha256=meta.checkpoint_sha256, model_sha256=model.sha256, model_path=model.path,
        loaded_at_unix_ns=model.loaded_at_ns, precision=meta.precision,
        device_requested=model.device_requested, provider=model.provider, providers=model.session.get_providers(),
        fallback_warning=model.fallback_warning,
        max_batch=limits.max_batch, max_message_bytes=limits.max_message_bytes, max_concurrent=limits.max_concurrent,
        torch_imported="torch" in sys.modules, server_version=package_version(),
        bar_columns=meta.column_map, calendar_tz=meta.feature_config.calendar_tz,
        calibration=calibration_info(meta.calibration, meta.quantiles),
        contract_pattern=CONTRACT_PATTERN if contracts is not None else "",
        roll_rule=contracts.describe() if contracts is not None else "",
        max_text_chars=MAX_TEXT_CHARS, max_columns=MAX_COLUMNS,
    )


def features_info(meta: ModelMeta) -> list[pb.Feature]:
    """Every model variable with its role, kind and source; a user categorical with its vocabulary."""
    config = meta.feature_config
    return [pb.Feature(name=f.name, role=ROLES[f.role], kind=f.kind.value, source=f.source,
                       vocabulary=config.vocabulary(f.name) if f.source == "user" and f.kind == Kind.CATEGORICAL
                       else ())
            for f in meta.feature_schema.features]


def calibration_info(calibration: dict[str, Any] | None, quantiles: tuple[float, ...]) -> pb.Calibration | None:
    """ModelMeta.calibration as the wire's Calibration; None (the field unset) for an uncalibrated model."""
    if calibration is None:
        return None
    before, after = calibration["coverage_before"], calibration["coverage_after"]
    levels = [f"{q:g}" for q in quantiles]
    return pb.Calibration(
        method=calibration["method"], validation_windows=calibration["validation_windows"],
        offsets=[x for row in calibration["offsets"] for x in row],  # row-major [H, Q]
        coverage_before=[before[q] for q in levels], coverage_after=[after[q] for q in levels],
        interval_coverage_before=before["interval"], interval_coverage_after=after["interval"],
    )
