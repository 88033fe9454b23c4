"""Who may call the server: TLS (mutual with a client CA), bearer tokens, and the clients' side of both.

The token file holds one token a line, so that an operator rotates tokens without downtime: add the new one, SIGHUP,
move the clients, remove the old one, SIGHUP. Tokens are compared as SHA-256 digests against every configured token (no
early exit), and never logged or echoed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import hmac
import ipaddress
import logging
import ssl
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from features.text import bounded
from serving.errors import ConfigError
from serving.logs import BurstLog, Schedule

log = logging.getLogger("serving")

OPEN_SERVICES = ("grpc.health.v1.Health",)  # reachable without a token
MIN_TOKEN_CHARS = 16  # shorter tokens are refused at start: guessable
AUTH_HEADER = "authorization"  # gRPC metadata keys are lower case
TOKEN_FLAG = "--auth-token-file"
Counter = Callable[[str, grpc.StatusCode], None]  # (full method name, code) of an answer given here


def read_file(path: Path, what: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read the {what}: {exc.strerror or exc}") from None
    if not data.strip():
        raise ConfigError(f"{flag} {path}: the {what} file is empty")
    return data


def read_pem(path: Path, what: str, flag: str) -> bytes:
    data = read_file(path, what, flag)
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line); give the {what} in PEM format")
    return data


def _token_lines(path: Path, none: str) -> list[tuple[int, str]]:
    """(line number, token) of each line but blank ones and '#' comments; ConfigError `none` when there is none."""
    try:
        text = read_file(path, "token", TOKEN_FLAG).decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"{TOKEN_FLAG} {path}: tokens must be printable ASCII (the file is not)") from None
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
             if line.strip() and not line.strip().startswith("#")]
    if not lines:
        raise ConfigError(f"{TOKEN_FLAG} {path}: {none}")
    return lines


def read_tokens(path: Path) -> list[str]:
    """The server's tokens, one a line; errors name the line, never its content."""
    lines = _token_lines(path, "no token in the file (blank lines and '#' comments are ignored)")
    for n, token in lines:
        if not all("!" <= c <= "~" for c in token):
            raise ConfigError(f"{TOKEN_FLAG} {path}, line {n}: a token must be printable ASCII without spaces")
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"{TOKEN_FLAG} {path}, line {n}: the token is shorter than {MIN_TOKEN_CHARS} "
                              "characters; use a random one, e.g. `openssl rand -hex 32`")
    warn_if_readable(Path(path), TOKEN_FLAG, "other users")
    return [token for _, token in lines]


def warn_if_readable(path: Path, flag: str, who: str) -> None:
    """A secret file (tokens, a TLS key) that users other than its owner may read: a warning naming the fix."""
    with contextlib.suppress(OSError):
        if (mode := path.stat().st_mode) & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s %s is readable by %s (mode %o); chmod 600 it", flag, path, who, stat.S_IMODE(mode))


class ReloadableTls:
    """Server TLS whose certificate, key and client CA a SIGHUP re-reads (renewal without a restart). gRPC asks
    `_fetch` before each new connection's handshake; files that fail their checks keep the current ones."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._pending: Any = None  # a grpc ServerCertificateConfiguration, once re-read
        self._lock = threading.Lock()  # _fetch runs on gRPC's threads
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._configuration(), self._fetch, require_client_authentication=client_ca is not None)

    def _configuration(self) -> Any:
        pair = (read_pem(self.key, "private key", "--tls-key"), read_pem(self.cert, "certificate", "--tls-cert"))
        ca = read_pem(self.client_ca, "client CA certificate", "--tls-client-ca") if self.client_ca else None
        check_tls_files(self.cert, self.key, self.client_ca)
        warn_if_readable(self.key, "--tls-key", "its group or other users")
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def reload(self) -> bool:
        """SIGHUP: re-read the files for new connections; False (and the current files kept) when they fail."""
        try:
            configuration = self._configuration()
        except ConfigError as exc:
            log.error("TLS reload refused, the current certificate stays: %s", exc)
            return False
        with self._lock:
            self._pending = configuration
        log.info("TLS files re-read: new connections get the certificate in %s", self.cert)
        return True

    def _fetch(self) -> Any:
        with self._lock:
            configuration, self._pending = self._pending, None
        return configuration


def check_tls_files(cert: Path, key: Path, client_ca: Path | None = None) -> None:
    """ConfigError unless OpenSSL takes the certificate chain with this key, and the client CA file: gRPC
    reports a bad pair as a failure to bind the port, this names the files."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # judge the pair, not its strength: gRPC takes keys OpenSSL calls weak
    try:  # an encrypted key gets an empty password (never a prompt): gRPC cannot use one either
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        raise ConfigError(f"--tls-cert {cert} with --tls-key {key}: OpenSSL refuses the pair ({exc.reason or exc}); "
                          "give the certificate chain and its own unencrypted private key") from None
    except OSError as exc:  # after SSLError, which is one: a file gone since it was read (a renewal)
        raise ConfigError(f"--tls-cert {cert} with --tls-key {key}: cannot read them: {exc.strerror or exc}") from None
    _check_dates(cert)
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as exc:
            raise ConfigError(f"--tls-client-ca {client_ca}: OpenSSL cannot read a CA certificate from it "
                              f"({exc.reason or exc}); give the PEM certificate(s) of the CA that signs client "
                              "certificates") from None


CERT_RENEW_WARNING_S = 7 * 86_400  # a certificate that expires sooner is named in a warning at start


def _check_dates(cert: Path, now: float | None = None) -> None:
    """ConfigError for a certificate expired or not valid yet (health would look fine while every handshake
    fails); a warning when it expires within a week."""
    try:
        info = ssl._ssl._test_decode_cert(str(cert))  # type: ignore[attr-defined]  # CPython's own decoder
        not_before, not_after = (ssl.cert_time_to_seconds(info[k]) for k in ("notBefore", "notAfter"))
    except (ssl.SSLError, OSError, KeyError, ValueError):
        return  # the pair check above judged the file readable; the dates are a courtesy
    now = time.time() if now is None else now
    if now >= not_after:
        raise ConfigError(f"--tls-cert {cert}: the certificate expired on {info['notAfter']}; every client would "
                          "refuse the handshake: renew it")
    if now < not_before:
        raise ConfigError(f"--tls-cert {cert}: the certificate is valid only from {info['notBefore']} (check this "
                          "machine's clock, or the certificate)")
    if not_after - now < CERT_RENEW_WARNING_S:
        log.warning("--tls-cert %s expires on %s (in %.1f days): renew it, then SIGHUP the server", cert,
                    info["notAfter"], (not_after - now) / 86_400)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def _refusal(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str,
             on_refuse: Callable[[str], None]) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that answers `code` without reading the request; on_refuse(peer) first."""

    async def refuse(request_or_iterator: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        on_refuse(context.peer())
        await context.abort(code, message)

    shape = (False, False) if handler is None else (handler.request_streaming, handler.response_streaming)
    return {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[shape](refuse)


class RefusalLog(BurstLog):
    """Token refusals at WARNING without flooding (BurstLog: their count every `every_s`), each at DEBUG too."""

    def __init__(self, every_s: float = 60.0, schedule: Schedule | None = None) -> None:
        super().__init__(functools.partial(log.warning, "%s"), functools.partial(
            log.warning, "refused %d more call(s) since the last such line; the latest: %s"), every_s, schedule)

    def __call__(self, method: str, peer: str, problem: str) -> None:
        what = f"refused {bounded(method, 120)} from {peer}: {problem}"
        if not self.note(what):  # held back for the count: at DEBUG meanwhile
            log.debug("%s", what)


class TokenAuth(aio.ServerInterceptor):
    """Bearer-token check on every RPC except the OPEN_SERVICES: a call without a valid
    `authorization: Bearer <token>` is UNAUTHENTICATED before its request is decoded."""

    def __init__(self, tokens: Sequence[str], count: Counter, path: Path) -> None:
        self._digests = tuple(_digest(t) for t in tokens)  # the tokens themselves are not kept
        self._count = count
        self.path = path  # the token file, re-read on SIGHUP
        self.refusals = RefusalLog()

    def reload(self) -> bool:
        """SIGHUP: re-read the token file (rotation); False (and the current tokens kept) when it is unusable."""
        try:
            tokens = read_tokens(self.path)
        except ConfigError as exc:
            log.error("token reload refused, the current tokens stay: %s", exc)
            return False
        self._digests = tuple(_digest(t) for t in tokens)
        log.info("token file re-read: %d token(s) accepted", len(tokens))
        return True

    def check(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
        """'' when the metadata carries a valid token, else what is wrong (never the token)."""
        values = [v for k, v in (metadata or ()) if k == AUTH_HEADER]
        if not values:
            return (f"missing credentials: send the metadata '{AUTH_HEADER}: Bearer <token>' "
                    "(the token from the server's --auth-token-file)")
        if len(values) > 1:
            return f"send the '{AUTH_HEADER}' metadata once"
        value = values[0].encode("latin-1", "replace") if isinstance(values[0], str) else values[0]
        scheme, _, presented = value.partition(b" ")
        if scheme.lower() != b"bearer" or not presented.strip():
            return f"the '{AUTH_HEADER}' metadata must be 'Bearer <token>'"
        given = _digest(presented.strip())
        matches = [hmac.compare_digest(given, d) for d in self._digests]  # every token, no early exit
        return "" if any(matches) else "invalid token"

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method, handler = handler_call_details.method, await continuation(handler_call_details)
        if method.lstrip("/").split("/", 1)[0] in OPEN_SERVICES:  # '/pkg.Service/Method': its service
            return handler
        if not (problem := self.check(handler_call_details.invocation_metadata)):
            return handler
        self._count(method, grpc.StatusCode.UNAUTHENTICATED)
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, problem,
                        lambda peer: self.refusals(method, peer, problem))


class UnknownMethods(aio.ServerInterceptor):
    """Counts calls to methods no service has (gRPC answers UNIMPLEMENTED); first, so TokenAuth's are not."""

    def __init__(self, count: Counter) -> None:
        self._count = count

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            self._count(handler_call_details.method, grpc.StatusCode.UNIMPLEMENTED)  # as `other`: bounded labels
        return handler


class OneLineDecodeErrors(logging.Filter):
    """gRPC answers a request that does not parse with UNKNOWN naming the message type, and logs it with a
    traceback: here one WARNING line, so that junk bytes cannot flood the log with tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, DecodeError):
            record.msg, record.args = f"{record.getMessage()}: {exc}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_ONE_LINE = OneLineDecodeErrors()  # one instance: addFilter adds it once


def one_line_decode_errors() -> None:
    logging.getLogger("grpc._cython.cygrpc").addFilter(_ONE_LINE)  # where gRPC logs what a handler raised


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS and authentication (match the server's flags)")
    g.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CA roots")
    g.add_argument("--tls-ca", type=Path, help="connect with TLS, trusting this CA certificate (PEM)")
    g.add_argument("--tls-cert", type=Path, help="client certificate (PEM) for a server with --tls-client-ca")
    g.add_argument("--tls-key", type=Path, help="private key (PEM) of --tls-cert")
    g.add_argument("--tls-server-name", help="name to verify the server certificate against, when it differs "
                                             "from the target's host (e.g. a container's 127.0.0.1)")
    g.add_argument("--auth-token-file", type=Path, help="send the first token of this file as "
                                                        "'authorization: Bearer <token>'")


MAX_TIMEOUT_S = 1e6  # a gRPC deadline far beyond this overflows its clock and passes at once


def check_client_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The TLS flags make sense together, and --timeout is a deadline gRPC can keep; p.error names what is not."""
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_server_name and not _wants_tls(args):
        p.error("--tls-server-name is for a TLS connection: add --tls (the system's CA roots) or --tls-ca FILE")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        p.error(f"--timeout {args.timeout:g}: give a deadline in seconds, above 0 and at most {MAX_TIMEOUT_S:g}")


def _wants_tls(args: argparse.Namespace) -> bool:
    return bool(args.tls or args.tls_ca or args.tls_cert)


def open_channel(target: str, args: argparse.Namespace) -> grpc.Channel:
    """A plaintext channel, or a TLS one when any TLS flag is set. ConfigError for unreadable files."""
    if not _wants_tls(args):
        return grpc.insecure_channel(target)
    ca = read_pem(args.tls_ca, "CA certificate", "--tls-ca") if args.tls_ca else None
    key = read_pem(args.tls_key, "private key", "--tls-key") if args.tls_key else None
    cert = read_pem(args.tls_cert, "certificate", "--tls-cert") if args.tls_cert else None
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(target, credentials, options=options)


def call_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    if args.auth_token_file is None:
        return ()
    token = _token_lines(args.auth_token_file, "no token in the file")[0][1]  # the first: what a client sends
    return ((AUTH_HEADER, f"Bearer {token}"),)


# the codes of a call that never reached a server: no connection, no answer in time, a target gRPC cannot use
# (UNKNOWN: "the target uri is not valid"; INTERNAL: "Illegal status code from resolver")
UNREACHED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
                       grpc.StatusCode.INTERNAL})


def first_call_error(method: str, exc: grpc.RpcError, target: str) -> str:
    """One line for a tool's first failed call: gRPC's words, and what to check when no server answered."""
    code, details = exc.code(), exc.details()
    if code in UNREACHED:
        return (f"cannot reach --target {target}: {code.name}: {details}; is a server running there "
                "(python -m serving --port PORT), and do the TLS flags match it?")
    return f"{method}: {code.name}: {details}"
