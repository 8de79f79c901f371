"""The worker's gRPC face: server, servicer, protobuf conversion, interceptors, TLS
and tokens, the metrics endpoint. Imports worker, core, client and the generated stubs."""
