"""Server reflection in both versions: `grpc.reflection.v1` and `grpc.reflection.v1alpha`.

grpcio-reflection serves only v1alpha (grpc/grpc#38576), while newer grpcurl,
grpcui and Postman ask for v1 first. The two are one service under two package
names, with the same messages field for field, so v1 is v1alpha's own servicer
registered under v1's method name: the bytes on the wire are the same. v1's
descriptor, which `describe` and the decode check's messages read, is v1alpha's
with the package renamed, added to the default descriptor pool once.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
_V1_FILE = "grpc/reflection/v1/reflection.proto"  # its path in grpc-proto


def v1_file() -> FileDescriptor:
    """The `grpc.reflection.v1` file in the default pool (added on the first call).

    Where something else has already put v1 there (a grpcio-reflection that
    ships it, say), that file is the one returned.
    """
    pool = descriptor_pool.Default()
    try:
        return pool.FindServiceByName(V1_SERVICE_NAME).file
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", f".{V1_PACKAGE}."
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name.removeprefix(old)
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type.removeprefix(old)
            method.output_type = new + method.output_type.removeprefix(old)
    pool.Add(proto)
    return pool.FindFileByName(_V1_FILE)


def enable_reflection(service_names: Iterable[str], server: grpc.Server | grpc.aio.Server) -> None:
    """Serves both reflection versions on `server`, listing `service_names` and themselves."""
    v1_file()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer: reflection.ReflectionServicer
    if isinstance(server, grpc.aio.Server):
        # grpc-stubs does not declare the async servicer's public alias, `aio`.
        servicer = reflection.aio.ReflectionServicer(names)  # type: ignore[attr-defined]
    else:
        servicer = reflection.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": info}),)
    )
