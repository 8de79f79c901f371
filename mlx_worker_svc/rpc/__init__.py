"""The worker's gRPC face: server, servicer, protobuf conversion, interceptors (metrics,
tokens, the decode check), TLS, health and reflection, the metrics endpoint. Imports
worker, core, client and the generated stubs."""
