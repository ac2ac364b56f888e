"""One error tree for the whole project, each error carrying its gRPC status and HTTP status.

    ServiceError (500)
    ├── InvalidArgument (400)      ├── Unauthenticated (401)   ├── PermissionDenied (403)
    ├── NotFound (404)             ├── Conflict (409)          ├── TooLarge (413)
    ├── Internal (500)             ├── Unimplemented (501)     ├── Unavailable (503)
    └── StorageFull (507)                                          └── Overloaded (503)

Domain code raises these; `shared.rpc.grpc_errors` sends them as gRPC statuses;
`shared.rpc.rpc_errors` turns a failed call back into one; the gateway answers `http_status`.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """A failure a caller should see, with the gRPC and HTTP statuses that describe it."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500
    kind: str = ""
    """Names the class on the wire when it shares its gRPC status with another."""

    def __init__(self, message: str, service: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.service = service
        """The backing service whose call failed with it (empty: raised in this process)."""


class InvalidArgument(ServiceError):
    """The request itself is wrong; sending it again will not help."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class Unauthenticated(ServiceError):
    """The request lacks the credentials the server requires."""

    code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class PermissionDenied(ServiceError):
    """The caller may not do this."""

    code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class NotFound(ServiceError):
    """What the request names does not exist (in the caller's scope)."""

    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class Conflict(ServiceError):
    """The request clashes with the current state."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409


class TooLarge(ServiceError):
    """The request is over a size limit."""

    # Not RESOURCE_EXHAUSTED: that one means "too busy now" (Overloaded), which a retry may cure.
    code = grpc.StatusCode.OUT_OF_RANGE
    http_status = 413


class Internal(ServiceError):
    """A bug or an unexpected failure; the message names an id to find it in the logs."""


class Unimplemented(ServiceError):
    """Not built yet; the message says what."""

    code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501


class Unavailable(ServiceError):
    """A backing service or dependency does not answer now; a retry later may succeed."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class Overloaded(Unavailable):
    """Too much work is queued already; a retry after a short wait may succeed."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StorageFull(ServiceError):
    """The disk the data is kept on is full: a write was not kept; one after space is freed is."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 507
    kind = "storage_full"


_BY_KIND: dict[str, type[ServiceError]] = {StorageFull.kind: StorageFull}

_BY_STATUS: dict[grpc.StatusCode, type[ServiceError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: TooLarge,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: Conflict,
    grpc.StatusCode.ALREADY_EXISTS: Conflict,
    grpc.StatusCode.ABORTED: Conflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.CANCELLED: Unavailable,
}


def error_for_status(
    code: grpc.StatusCode, message: str, service: str = "", kind: str = ""
) -> ServiceError:
    """The ServiceError a gRPC status (and the kind sent beside it) stands for (Internal for
    any status not listed)."""
    return _BY_KIND.get(kind, _BY_STATUS.get(code, Internal))(message, service)


class ConfigError(Exception):
    """A setting that stops a service from starting."""
