"""The worker's gRPC face, and the gRPC edge pieces the fleet and gateway share.

The worker's server (health, reflection, the one drain path), its servicer (one
thin method per RPC), protobuf <-> domain conversion; and, shared: the map from
core error codes to gRPC status codes (`status`), the interceptors that count
RPCs and turn undecodable requests into INVALID_ARGUMENT (`metrics`, `decoding`),
the health and reflection services, the metrics endpoint, and TLS, mutual TLS and
bearer tokens (`security`). Imports worker, engine, core, client (channel
credentials), grpc and the generated code. The fleet and gateway import only the
shared pieces, which import nothing of the worker.
"""
