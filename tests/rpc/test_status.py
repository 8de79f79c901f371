"""The core error codes and the one map from them to gRPC status codes."""

from __future__ import annotations

import grpc
import pytest

from mlx_worker_svc.core import errors
from mlx_worker_svc.rpc.status import grpc_code


@pytest.mark.parametrize("code", list(errors.Code), ids=lambda c: c.name)
def test_every_code_maps_to_the_grpc_status_of_its_name_and_number(code: errors.Code) -> None:
    status = grpc_code(code)
    assert (status.name, status.value[0]) == (code.name, code.value)


def test_each_error_class_carries_the_status_it_is_named_after() -> None:
    expected = {
        errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
        errors.NotFound: grpc.StatusCode.NOT_FOUND,
        errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
        errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
        errors.Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
        errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
        errors.Aborted: grpc.StatusCode.ABORTED,
        errors.Internal: grpc.StatusCode.INTERNAL,
        errors.WorkerError: grpc.StatusCode.INTERNAL,
    }
    assert {cls: grpc_code(cls("x").code) for cls in expected} == expected
