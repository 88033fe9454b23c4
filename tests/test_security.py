"""Access to the server: loopback by default, TLS, mutual TLS, bearer tokens, and no file a request names.

Certificates are made at test time with the `openssl` command (the `cryptography` package
is not a dependency): a throwaway CA, a server certificate for 127.0.0.1/localhost signed
by it, a client certificate signed by it, and a rogue CA with its own client certificate.
Each server is the real `python -m serving` subprocess on a tiny real model.
"""

from __future__ import annotations

import ast
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from serving.__main__ import main as serve_main
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from tests.artifacts import REPO
from tests.live_server import SERVICE, LiveServer, Model, metric, request_for, tiny_model  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow]

TOKEN = "tok-" + "7f3a9c2e51d84b06a1e9" * 2  # what the tests grep the server's log for
OTHER_TOKEN = "tok-" + "0b1c2d3e4f5a6b7c8d9e" * 2
WRONG_TOKEN = "tok-" + "deadbeefdeadbeefdead" * 2
HEALTH = health_pb2.HealthCheckRequest(service=SERVICE)


# ---- a throwaway PKI -------------------------------------------------------------------------------
@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_cert: Path
    rogue_key: Path

    def read(self, *paths: Path) -> list[bytes]:
        return [p.read_bytes() for p in paths]


def _openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:  # only the TLS tests need it; the others run anyway
        pytest.skip("making a throwaway PKI needs the openssl command")
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue_ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
                             "basicConstraints=CA:FALSE\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
    _leaf(d, "rogue", "rogue_ca", "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key",
               d / "rogue_ca.pem", d / "rogue.pem", d / "rogue.key")


def tls_channel(target: str, ca: Path, cert: Path | None = None, key: Path | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes(),
                                         private_key=key.read_bytes() if key else None,
                                         certificate_chain=cert.read_bytes() if cert else None)
    return grpc.secure_channel(target, creds)


def health_code(channel: grpc.Channel) -> str:
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(HEALTH, timeout=5).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    except grpc.RpcError as exc:
        return exc.code().name


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


# ---- binding ----------------------------------------------------------------------------------------
def test_binds_loopback_only_by_default(tiny_model: Model, tmp_path: Path) -> None:  # noqa: F811
    s = LiveServer(tiny_model.model, tmp_path / "server.log")  # no --host
    try:
        assert s.address == "127.0.0.1"
        s.wait_serving()
        listening = [c.laddr for c in psutil.Process(s.proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(_loopback(addr.ip) for addr in listening), listening  # (::ffff:127.0.0.1 is too)
        others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127.")]
        for ip in others:  # the port is not reachable through any other interface of this host
            with pytest.raises(OSError), socket.create_connection((ip, s.port), timeout=2):
                pass
    finally:
        s.kill()


def test_metrics_bind_their_own_interface_with_metrics_host(tiny_model: Model, tmp_path: Path) -> None:  # noqa: F811
    """--metrics-host puts /metrics (no TLS, no tokens) on another interface than gRPC: here gRPC on 127.0.0.1
    and metrics on 127.0.0.2 only; an address this machine does not have stops the start, naming the flag."""
    s = LiveServer(tiny_model.model, tmp_path / "server.log", "--metrics-port", "0", "--metrics-host", "127.0.0.2")
    try:
        s.wait_serving()
        host, port = s.metrics.rsplit(":", 1)
        assert host == "127.0.0.2"
        assert "foxhunt_ready 1.0" in s.scrape()
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", int(port)), timeout=2):
            pass
        assert s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).bars_required > 0
    finally:
        s.kill()
    r = subprocess.run([sys.executable, "-m", "serving", "--model", str(tiny_model.model), "--device", "cpu",
                        "--port", "0", "--metrics-port", "0", "--metrics-host", "192.0.2.1"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and "listening" not in r.stdout and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(errors) == 1 and "192.0.2.1" in errors[0] and "--metrics-host" in errors[0], errors
    r = subprocess.run([sys.executable, "-m", "serving", "--model", str(tiny_model.model), "--metrics-host",
                        "127.0.0.1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--metrics-host needs --metrics-port" in r.stderr, r.stderr[-2000:]


# ---- TLS ---------------------------------------------------------------------------------------------
def test_tls_serves_only_tls_and_the_cli_tools_speak_it(tiny_model: Model, pki: Pki, tmp_path: Path) -> None:  # noqa: F811
    s = LiveServer(tiny_model.model, tmp_path / "server.log", "--tls-cert", str(pki.server_cert),
                   "--tls-key", str(pki.server_key))
    try:
        with tls_channel(s.target, pki.ca) as channel:
            s.wait_serving(channel)
            request = request_for(tiny_model, tiny_model.meta.symbols[0])
            assert pb_grpc.ForecasterStub(channel).Predict(request, timeout=10).forecasts
        with grpc.insecure_channel(s.target) as plain:  # plaintext to a TLS port: no answer
            assert health_code(plain) == "UNAVAILABLE"
        with tls_channel(s.target, pki.rogue_ca) as untrusted:  # a server certificate the client does not trust
            assert health_code(untrusted) == "UNAVAILABLE"

        ok = run_module("serving.health_probe", "--target", s.target, "--tls-ca", str(pki.ca))
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        plain_probe = run_module("serving.health_probe", "--target", s.target, "--timeout", "2")
        assert plain_probe.returncode == 1
        client = run_module("serving.client", "--target", s.target, "--parquet", str(tiny_model.bars_path),
                            "--symbol", tiny_model.meta.symbols[0], "--tls-ca", str(pki.ca))
        assert client.returncode == 0 and client.stdout.startswith(tiny_model.meta.symbols[0]), client.stderr
        assert s.alive()
    finally:
        s.kill()


def test_sighup_rereads_the_tls_files_for_new_connections_and_refuses_unusable_ones(
        tiny_model: Model, pki: Pki, tmp_path: Path) -> None:  # noqa: F811
    """A renewed certificate without a restart: the files replaced, SIGHUP, and new connections get it (here one
    from another CA, so that which certificate a client met shows); an unusable replacement keeps the current."""
    d = pki.ca.parent
    _leaf(d, "renewed", "rogue_ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
                                    "basicConstraints=CA:FALSE\n")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    key.chmod(0o600)
    s = LiveServer(tiny_model.model, tmp_path / "server.log", "--tls-cert", str(cert), "--tls-key", str(key),
                   "--metrics-port", "0")
    try:
        with tls_channel(s.target, pki.ca) as channel:
            s.wait_serving(channel)
        cert.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")  # half renewed
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "TLS reload refused, the current certificate stays" not in s.log_text():
            assert time.monotonic() < deadline and s.alive(), s.log_text()[-2000:]
            time.sleep(0.05)
        with tls_channel(s.target, pki.ca) as channel:
            assert health_code(channel) == "SERVING"
        cert.write_bytes((d / "renewed.pem").read_bytes())
        key.write_bytes((d / "renewed.key").read_bytes())
        s.proc.send_signal(signal.SIGHUP)
        while "TLS files re-read" not in s.log_text():
            assert time.monotonic() < deadline and s.alive(), s.log_text()[-2000:]
            time.sleep(0.05)
        with tls_channel(s.target, pki.rogue_ca) as renewed:  # the new certificate, signed by the other CA
            assert health_code(renewed) == "SERVING"
        with tls_channel(s.target, pki.ca) as old:
            assert health_code(old) == "UNAVAILABLE"
        text = s.scrape()  # an operator alerts on refused reloads: the log line alone is easy to miss
        assert metric(text, "foxhunt_reloads_total", file="tls", result="refused") == 1
        assert metric(text, "foxhunt_reloads_total", file="tls", result="ok") == 1
        assert metric(text, "foxhunt_reloads_total", file="tokens", result="ok") == 0  # no token file in use
    finally:
        s.kill()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(tiny_model: Model, pki: Pki,  # noqa: F811
                                                               tmp_path: Path) -> None:
    s = LiveServer(tiny_model.model, tmp_path / "server.log", "--tls-cert", str(pki.server_cert),
                   "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca))
    try:
        with tls_channel(s.target, pki.ca, pki.client_cert, pki.client_key) as channel:
            s.wait_serving(channel)
            info = pb_grpc.ForecasterStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert info.model_version == tiny_model.meta.model_version
        with tls_channel(s.target, pki.ca) as no_cert:
            assert health_code(no_cert) == "UNAVAILABLE"
        with tls_channel(s.target, pki.ca, pki.rogue_cert, pki.rogue_key) as rogue:
            assert health_code(rogue) == "UNAVAILABLE"
        probe = run_module("serving.health_probe", "--target", s.target, "--tls-ca", str(pki.ca), "--tls-cert",
                           str(pki.client_cert), "--tls-key", str(pki.client_key))
        assert probe.returncode == 0, probe.stderr
        assert run_module("serving.health_probe", "--target", s.target, "--tls-ca", str(pki.ca)).returncode == 1
        assert s.alive()
    finally:
        s.kill()


# ---- bearer tokens ---------------------------------------------------------------------------------------
def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _code(call: object, *args: object, **kwargs: object) -> tuple[str, str]:
    try:
        result = call(*args, **kwargs)  # type: ignore[operator]
        if hasattr(result, "__iter__") and not hasattr(result, "SerializeToString"):
            list(result)
        return "OK", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""


@pytest.fixture
def token_server(tiny_model: Model, pki: Pki, tmp_path: Path) -> Iterator[tuple[LiveServer, Path]]:  # noqa: F811
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# one token a line\n{TOKEN}\n\n{OTHER_TOKEN}\n")
    tokens.chmod(0o600)
    s = LiveServer(tiny_model.model, tmp_path / "server.log", "--auth-token-file", str(tokens),
                   "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--log-level", "DEBUG",
                   "--metrics-port", "0")
    try:
        yield s, tokens
    finally:
        s.kill()


def test_token_needed_for_everything_but_health(tiny_model: Model, pki: Pki,  # noqa: F811
                                                token_server: tuple[LiveServer, Path]) -> None:
    s, tokens = token_server
    request = request_for(tiny_model, tiny_model.meta.symbols[0])
    reflect_request = [reflection_pb2.ServerReflectionRequest(list_services="")]
    with tls_channel(s.target, pki.ca) as channel:
        s.wait_serving(channel)  # health: no token needed
        for method in ("Predict", "PredictStream"):  # at zero before the first refusal: increase() sees that one
            assert f'foxhunt_requests_total{{code="UNAUTHENTICATED",method="{method}"}} 0.0' in s.scrape()
        stub = pb_grpc.ForecasterStub(channel)
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        unknown = channel.unary_unary(f"/{SERVICE}/NoSuchMethod", request_serializer=None,
                                      response_deserializer=None)
        reflect_v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                           request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                           response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        refused = {
            "no token": (),
            "wrong token": _bearer(WRONG_TOKEN),
            "no scheme": (("authorization", TOKEN),),
            "other scheme": (("authorization", f"Basic {TOKEN}"),),
            "token prefix": _bearer(TOKEN[:-1]),
            "token twice": _bearer(TOKEN) + _bearer(TOKEN),
        }
        for case, metadata in refused.items():
            for name, call, arg in (("Predict", stub.Predict, request),
                                    ("PredictStream", stub.PredictStream, iter([request])),
                                    ("GetModelInfo", stub.GetModelInfo, pb.GetModelInfoRequest()),
                                    ("reflection", reflect.ServerReflectionInfo, iter(reflect_request)),
                                    ("reflection v1", reflect_v1, iter(reflect_request)),
                                    ("unknown method", unknown, b"")):
                code, details = _code(call, arg, timeout=5, metadata=metadata)
                assert code == "UNAUTHENTICATED", (case, name, code, details)
                assert TOKEN not in details and WRONG_TOKEN not in details and TOKEN[:-1] not in details
        # each refusal is counted once, as what the caller got: an unknown method refused for its token is
        # UNAUTHENTICATED, not also UNIMPLEMENTED
        text = s.scrape()
        for method, calls in (("Predict", 1), ("PredictStream", 1), ("GetModelInfo", 1),
                              ("other", 3)):  # other: reflection (v1alpha and v1), unknown
            assert metric(text, "foxhunt_requests_total", method=method, code="UNAUTHENTICATED") == \
                calls * len(refused), method
        assert metric(text, "foxhunt_requests_total", method="other", code="UNIMPLEMENTED") == 0
        huge = _code(stub.GetModelInfo, pb.GetModelInfoRequest(), timeout=5, metadata=_bearer("x" * 20_000))
        assert huge[0] == "RESOURCE_EXHAUSTED", huge  # gRPC's own metadata limit (16 KiB), before any of our code
        for token in (TOKEN, OTHER_TOKEN):  # every token of the file works
            assert stub.Predict(request, timeout=10, metadata=_bearer(token)).forecasts
            assert next(stub.PredictStream(iter([request]), timeout=10, metadata=_bearer(token))).response.forecasts
            assert _code(reflect.ServerReflectionInfo, iter(reflect_request), timeout=5,
                         metadata=_bearer(token)) == ("OK", "")
        assert _code(unknown, b"", timeout=5, metadata=_bearer(TOKEN))[0] == "UNIMPLEMENTED"
        assert metric(s.scrape(), "foxhunt_requests_total", method="other", code="UNIMPLEMENTED") == 1
        assert health_pb2_grpc.HealthStub(channel).Check(HEALTH, timeout=5, metadata=_bearer(WRONG_TOKEN)).status \
            == health_pb2.HealthCheckResponse.SERVING  # health ignores tokens, even wrong ones

        # the CLI tools: the client needs the token, the probe does not
        assert run_module("serving.health_probe", "--target", s.target, "--tls-ca", str(pki.ca)).returncode == 0
        args = ("serving.client", "--target", s.target, "--parquet", str(tiny_model.bars_path), "--symbol",
                tiny_model.meta.symbols[0], "--tls-ca", str(pki.ca))
        no = run_module(*args)
        assert no.returncode == 1 and "UNAUTHENTICATED" in no.stderr
        client_tokens = tokens.parent / "client_token"
        client_tokens.write_text(f"{OTHER_TOKEN}\n")
        yes = run_module(*args, "--auth-token-file", str(client_tokens))
        assert yes.returncode == 0, yes.stderr

        # rotation: rewrite the file and SIGHUP; the removed token stops working, the new one works
        tokens.write_text(f"{OTHER_TOKEN}\n")
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while _code(stub.GetModelInfo, pb.GetModelInfoRequest(), timeout=5, metadata=_bearer(TOKEN))[0] == "OK":
            assert time.monotonic() < deadline, s.log_text()
            time.sleep(0.1)
        assert _code(stub.GetModelInfo, pb.GetModelInfoRequest(), timeout=5, metadata=_bearer(TOKEN))[0] == \
            "UNAUTHENTICATED"
        assert stub.Predict(request, timeout=10, metadata=_bearer(OTHER_TOKEN)).forecasts
        assert metric(s.scrape(), "foxhunt_reloads_total", file="tokens", result="ok") == 1
        tokens.write_text("# every token removed by mistake\n")  # refused: the current tokens stay
        s.proc.send_signal(signal.SIGHUP)
        while metric(s.scrape(), "foxhunt_reloads_total", file="tokens", result="refused") == 0:
            assert time.monotonic() < deadline and s.alive(), s.log_text()[-2000:]
            time.sleep(0.1)
        assert stub.Predict(request, timeout=10, metadata=_bearer(OTHER_TOKEN)).forecasts
        assert s.alive()

    log = s.log_text()
    # the first refusal at WARNING with the caller's address; the rest of the minute's at DEBUG, counted in a line
    # when the minute ends (or at the stop)
    warned = [line for line in log.splitlines() if "WARNING" in line and " refused " in line]
    assert " from ipv4:127.0.0.1:" in warned[0] and "missing credentials" in warned[0], warned
    assert all("more call(s) since the last such line; the latest: refused '/" in line for line in warned[1:]), warned
    assert log.count(" refused '/") > 30  # every refusal logged (at DEBUG) ...
    for secret in (TOKEN, OTHER_TOKEN, WRONG_TOKEN, TOKEN[:-1], TOKEN[4:20], WRONG_TOKEN[4:20]):
        assert secret not in log  # ... and no token, nor a piece of one, ever was


def test_bad_access_files_stop_the_start_with_a_message(tmp_path: Path, pki: Pki,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2, one line naming the flag, no traceback; checked before the model is even read."""
    model = tmp_path / "never-read.onnx"
    short = tmp_path / "short"
    short.write_text("abc\n")
    empty = tmp_path / "empty"
    empty.write_text("# just a comment\n\n")
    spaced = tmp_path / "spaced"
    spaced.write_text("a token with spaces in it\n")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    cases = [
        (["--auth-token-file", str(tmp_path / "missing")], "--auth-token-file"),
        (["--auth-token-file", str(short)], "shorter than 16 characters"),
        (["--auth-token-file", str(empty)], "no token in the file"),
        (["--auth-token-file", str(spaced)], "printable ASCII without spaces"),
        (["--tls-cert", str(not_pem), "--tls-key", str(pki.server_key)], "--tls-cert"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(tmp_path / "missing.key")], "--tls-key"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(not_pem)],
         "--tls-client-ca"),
        # PEM files that are not what the flag needs: found before the port is bound, and named
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.client_key)], "OpenSSL refuses the pair"),
        (["--tls-cert", str(pki.server_key), "--tls-key", str(pki.server_cert)], "OpenSSL refuses the pair"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca",
          str(pki.client_key)], "--tls-client-ca"),
    ]
    for flags, message in cases:
        assert serve_main(["--model", str(model), "--port", "0", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err, err
        assert "abc" not in err and "spaces in it" not in err  # a token file's content is never repeated
    for flags in (["--tls-cert", str(pki.server_cert)], ["--tls-client-ca", str(pki.ca)]):
        with pytest.raises(SystemExit) as info:
            serve_main(["--model", str(model), *flags])
        assert info.value.code == 2
        assert "--tls" in capsys.readouterr().err


# ---- what a request can reach ------------------------------------------------------------------------------
PATHLIKE = ("path", "file", "dir", "url", "uri", "location", "filename")


def test_requests_carry_no_paths() -> None:
    """Every string a request can carry is a symbol, a user-feature column name, a category label (looked up in
    the model's vocabularies) or the request_id a stream only echoes back, and its one bytes field is the packed
    block of user-feature values (decoded as float64 only); none names a file."""
    service = pb.DESCRIPTOR.services_by_name["Forecaster"]
    strings: set[str] = set()
    seen: set[str] = set()

    def walk(message: object) -> None:
        name = message.full_name  # type: ignore[attr-defined]
        if name in seen:
            return
        seen.add(name)
        for f in message.fields:  # type: ignore[attr-defined]
            assert not any(w in f.name.lower() for w in PATHLIKE), f"{name}.{f.name}"
            if f.type == f.TYPE_STRING or f.type == f.TYPE_BYTES:
                strings.add(f"{name}.{f.name}")
            if f.message_type is not None:
                walk(f.message_type)

    for method in service.methods:
        walk(method.input_type)
    assert strings == {"foxhunt.tft.v1.Series.symbol", "foxhunt.tft.v1.Column.name",
                       "foxhunt.tft.v1.Series.user_feature_names", "foxhunt.tft.v1.Series.user_features_raw",
                       "foxhunt.tft.v1.PredictRequest.request_id", "foxhunt.tft.v1.Labels.name",
                       "foxhunt.tft.v1.Labels.values", "foxhunt.tft.v1.Series.StaticFeaturesEntry.key",
                       "foxhunt.tft.v1.Series.StaticCategoricalFeaturesEntry.key",
                       "foxhunt.tft.v1.Series.StaticCategoricalFeaturesEntry.value",
                       "foxhunt.tft.v1.Series.contracts"}


READERS = {"open", "read_bytes", "read_text", "read_bars", "read_contract_bars", "read_table", "InferenceSession",
           "load", "load_model", "TemporaryFile", "write_bytes", "write_text", "unlink", "remove", "rename", "replace",
           "mkdir"}


def test_the_server_opens_only_its_own_files() -> None:
    """Every call in the server's modules that touches the filesystem, and where it is: the model file
    (load_model, from --model), the TLS and token files (read_file), the client's --parquet, and the offline
    scorer's --model and --parquet. None takes a value from a request."""
    found = set()
    for path in sorted((REPO / "serving").glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):  # calls, and functions handed to a call (e.g. to a thread)
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                names = [f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""]
                names += [a.id for a in node.args if isinstance(a, ast.Name)]  # (bar columns are attributes: `s.open`)
                for name in names:
                    if name in READERS:
                        found.add(f"{path.stem}.{fn.name}:{name}")
    assert found == {
        "model._read:read_bytes",  # --model
        "model._new_session:InferenceSession",  # from those bytes, not a path
        "model.load_and_warm:load_model",  # SIGHUP: --model again
        "server.serve:load_model",  # --model
        "security.read_file:read_bytes",  # --tls-*, --auth-token-file (server and clients)
        # the client's own --parquet and --future
        "request_from_bars.symbol_bars:read_contract_bars", "request_from_bars.read_future:read_table",
        # the offline scorer (python -m serving.score, no server): its --model and --parquet (--out is written by
        # features.files.atomic_output)
        "score._run:load_model", "score._run:read_contract_bars",
        "score.parse_time:replace",  # datetime.replace(tzinfo=UTC): no file
        "reflection._v1_file:replace",  # str.replace of a package name in a type name: no file
        # dataclasses.replace: no file
        "workers._spawn:replace", "workers.run_workers:replace", "validation._for_the_wire:replace",
        "validation.take:replace", "validation.tail:replace",
        "request_from_bars.symbol_bars:replace", "request_from_bars.root_bars:replace",
    }, sorted(found)


def test_token_refusals_are_warned_about_at_once_then_counted_each_minute(caplog: pytest.LogCaptureFixture) -> None:
    """A refusal after a quiet spell gets a WARNING line with the caller and reason; the ones that follow are
    counted in one line a minute while they go on (the minutes run on a fake scheduler); each at DEBUG too."""
    from serving.security import RefusalLog

    due: list[Callable[[], None]] = []  # what the event loop would run a minute later
    refusals = RefusalLog(every_s=60.0, schedule=lambda delay, fn: due.append(fn) is None)
    method = "/foxhunt.tft.v1.Forecaster/Predict"
    with caplog.at_level("DEBUG", logger="serving"):
        refusals(method, "ipv4:10.0.0.7:4242", "invalid token")  # a line at once
        for port in range(1000):  # a stale client in a loop, or callers rotating addresses: counted
            refusals(method, f"ipv4:10.0.0.8:{port}", "missing credentials")
        due.pop()()  # the minute ends: one count
        due.pop()()  # a quiet minute: no line, and the next refusal gets one at once
        assert not due
        refusals(method, "ipv4:10.0.0.9:1", "invalid token")
        refusals(method, "ipv4:10.0.0.9:2", "invalid token")
        refusals.flush()  # the server stops: what is counted is said
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        f"refused '{method}' from ipv4:10.0.0.7:4242: invalid token",
        f"refused 1000 more call(s) since the last such line; the latest: refused '{method}' from "
        "ipv4:10.0.0.8:999: missing credentials",
        f"refused '{method}' from ipv4:10.0.0.9:1: invalid token",
        f"refused 1 more call(s) since the last such line; the latest: refused '{method}' from ipv4:10.0.0.9:2: "
        "invalid token",
    ]
    assert len([r for r in caplog.records if r.levelname == "DEBUG"]) == 1001  # each held one, at DEBUG


def test_token_file_permissions_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from serving.security import read_tokens

    path = tmp_path / "tokens"
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)
    assert read_tokens(path) == [TOKEN]
    assert "readable by other users" in caplog.text and TOKEN not in caplog.text
    caplog.clear()
    os.chmod(path, 0o600)
    read_tokens(path)
    assert "readable" not in caplog.text


def test_a_weak_but_matching_tls_pair_is_left_to_grpc(tmp_path: Path) -> None:
    """The pair check judges whether key and certificate belong together, not how strong they are: gRPC
    serves a 1024-bit RSA key, which OpenSSL's default security level would refuse."""
    from serving.security import check_tls_files

    _openssl("req", "-x509", "-newkey", "rsa:1024", "-nodes", "-keyout", "k.pem", "-out", "c.pem", "-days", "1",
             "-subj", "/CN=weak", cwd=tmp_path)
    check_tls_files(tmp_path / "c.pem", tmp_path / "k.pem")
    grpc.ssl_server_credentials([((tmp_path / "k.pem").read_bytes(), (tmp_path / "c.pem").read_bytes())])


def test_an_expired_or_not_yet_valid_certificate_is_refused_and_a_soon_expiring_one_warned(
        pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """gRPC serves an expired certificate, and every client then fails its handshake while health looks
    fine: the start refuses it, naming the date; one that expires within a week is a warning."""
    from serving.errors import ConfigError
    from serving.security import _check_dates, check_tls_files

    d = pki.ca.parent
    db = tmp_path / "db"
    (db / "new").mkdir(parents=True)
    (db / "index.txt").write_text("")
    (db / "serial").write_text("1000\n")
    (tmp_path / "ca.cnf").write_text(f"[ca]\ndefault_ca = c\n[c]\ndir = {db}\ndatabase = $dir/index.txt\n"
                                     "new_certs_dir = $dir/new\nserial = $dir/serial\ndefault_md = sha256\n"
                                     "policy = p\n[p]\ncommonName = supplied\n")
    _openssl("ca", "-batch", "-config", str(tmp_path / "ca.cnf"), "-cert", str(pki.ca), "-keyfile", str(d / "ca.key"),
             "-in", str(d / "server.csr"), "-out", str(tmp_path / "expired.pem"), "-startdate", "20200101000000Z",
             "-enddate", "20200102000000Z", cwd=tmp_path)
    with pytest.raises(ConfigError, match="the certificate expired on Jan  2 00:00:00 2020 GMT"):
        check_tls_files(tmp_path / "expired.pem", pki.server_key)
    start = 1_577_836_800.0  # 2020-01-01T00:00:00Z, the certificate's first second
    with pytest.raises(ConfigError, match="valid only from Jan  1 00:00:00 2020 GMT"):
        _check_dates(tmp_path / "expired.pem", now=start - 60)
    with caplog.at_level("WARNING", logger="serving"):
        _check_dates(tmp_path / "expired.pem", now=start + 3600)
    assert "expires on Jan  2 00:00:00 2020 GMT (in 1.0 days): renew it, then SIGHUP the server" in caplog.text


def test_a_tls_key_readable_by_others_is_warned_about(pki: Pki, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    from serving.security import ReloadableTls

    key = tmp_path / "server.key"
    key.write_bytes(pki.server_key.read_bytes())
    key.chmod(0o600)
    with caplog.at_level("WARNING", logger="serving"):
        ReloadableTls(pki.server_cert, key)
    assert "readable by" not in caplog.text
    key.chmod(0o644)
    with caplog.at_level("WARNING", logger="serving"):
        ReloadableTls(pki.server_cert, key)
    assert f"--tls-key {key} is readable by its group or other users (mode 644); chmod 600 it" in caplog.text
    from serving.errors import ConfigError
    from serving.security import check_tls_files

    with pytest.raises(ConfigError, match="cannot read them"):  # gone since it was read: a renewal in progress
        check_tls_files(pki.server_cert, tmp_path / "gone.key")
    with pytest.raises(ConfigError, match="OpenSSL refuses the pair"):  # an SSLError is an OSError: told apart
        check_tls_files(pki.server_cert, pki.client_key)
