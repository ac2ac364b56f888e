"""One error tree for the whole project, each error carrying its gRPC status."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """A failure a caller should see, with the gRPC status that describes it."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class Conflict(ServiceError):
    """The request clashes with the current state (HTTP 409)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class TooLarge(ServiceError):
    """The request is over a size limit (HTTP 413)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(ServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED


class ConfigError(Exception):
    """A setting that stops a service from starting."""
