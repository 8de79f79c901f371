"""Typed gRPC clients for WorkerService (asyncio and sync). Imports the generated stubs."""
