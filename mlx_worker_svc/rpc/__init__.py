"""The worker's gRPC face, and the gRPC edge pieces the fleet and gateway share.

The worker's server (health, reflection, the one drain path), its servicer (one
thin method per RPC), protobuf <-> domain conversion; and, shared: the map from
core error codes to gRPC status codes (`status`), the metric interceptors and
endpoint (`metrics`), TLS, mutual TLS and bearer tokens (`security`). Imports
worker, engine, core, client (channel credentials), grpc and the generated code.
The fleet and gateway import only `status`, `metrics` and `security`, which import
nothing of the worker.
"""
