"""Server reflection: what generic clients (grpcurl, grpcui, Postman) discover the services by.

grpcio-reflection serves only `grpc.reflection.v1alpha` and cannot find a method. Here, as in gRPC's C++ and Go servers,
the servicer also answers as `grpc.reflection.v1` (the same messages under another package), and a method (what `grpcurl
describe` asks for) is found in its service's file.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc import aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1ALPHA, _V1 = "grpc.reflection.v1alpha", "grpc.reflection.v1"


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: v1alpha's file under the v1 package, without its options."""
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    file.name, file.package = "grpc/reflection/v1/reflection.proto", _V1
    file.ClearField("options")
    renamed = f".{_V1ALPHA}.", f".{_V1}."
    for field in (f for message in file.message_type for f in message.field):  # v1alpha's messages nest none
        if field.HasField("type_name"):
            field.type_name = field.type_name.replace(*renamed)
    for method in (m for service in file.service for m in service.method):
        method.input_type, method.output_type = (method.input_type.replace(*renamed),
                                                 method.output_type.replace(*renamed))
    return file


class _ReflectionPool:
    """The default descriptor pool, with v1 reflection's file beside it and methods found by their service."""

    def __init__(self) -> None:
        self._pool = descriptor_pool.Default()
        self._v1 = descriptor_pool.DescriptorPool()  # its own pool: a later grpcio-reflection's v1 may load its own
        self._v1.Add(_v1_file())

    def _for(self, symbol: str) -> descriptor_pool.DescriptorPool:
        return self._v1 if symbol.startswith(f"{_V1}.") or symbol.startswith("grpc/reflection/v1/") else self._pool

    def __getattr__(self, name: str) -> Any:  # the look-ups reflection makes by extension: the default pool's
        return getattr(self._pool, name)

    def FindFileByName(self, name: str) -> FileDescriptor:
        return self._for(name).FindFileByName(name)

    def FindFileContainingSymbol(self, symbol: str) -> FileDescriptor:
        pool = self._for(symbol)
        try:
            return pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service, _, method = symbol.rpartition(".")
            try:
                found = pool.FindServiceByName(service)
            except KeyError:
                raise KeyError(symbol) from None
            if method not in found.methods_by_name:
                raise KeyError(symbol) from None
            return found.file


def enable_server_reflection(service_names: Iterable[str], server: aio.Server) -> None:
    """Serve reflection for `service_names` and for itself, under both names, on `server`."""
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names, pool=_ReflectionPool())  # type: ignore[attr-defined]
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
    }),))
