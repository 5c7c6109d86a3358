"""The one error hierarchy of the mesh; each class carries its gRPC status code.

Domain code raises these; one server interceptor (``shared.interceptors``)
turns them into gRPC statuses, and the HTTP adapter maps the same codes to
HTTP statuses, so the two maps cannot drift apart.

::

    MeshError                      (INTERNAL, generic message to the client)
    ├── ModelError                 (INTERNAL: a model's own code reported a failure)
    ├── InvalidArgument            (INVALID_ARGUMENT: bad tensor, field, config)
    │   └── ConfigError            (a config file is wrong: names file and line)
    ├── NotFound                   (NOT_FOUND: unknown model or version)
    ├── AlreadyExists              (ALREADY_EXISTS: a name registered twice)
    ├── Overloaded                 (RESOURCE_EXHAUSTED: queue full, rate limit)
    ├── Unavailable                (UNAVAILABLE: not ready, draining, stage down)
    │   └── RequestTimeout         (UNAVAILABLE: queue timeout with REJECT)
    ├── DeadlineExceeded           (DEADLINE_EXCEEDED: the caller's deadline)
    ├── Cancelled                  (CANCELLED: the caller went away)
    ├── Unimplemented              (UNIMPLEMENTED: an RPC or feature we lack)
    └── FailedPrecondition         (FAILED_PRECONDITION: e.g. unload a busy model)

Anything that is not a ``MeshError`` is a bug: the interceptor answers INTERNAL
with a generic message and logs the traceback.
"""

from __future__ import annotations

import grpc

MAX_MESSAGE_CHARS = 1000
"""An error's message is cut to this: it may echo what a caller sent (a model
name of any length), and an oversized gRPC status makes a proxy reset the
connection it shares with other callers' requests."""


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to ``limit`` characters, saying how much was left out."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message) - limit} more characters)"


class MeshError(Exception):
    """Base of every error the mesh reports on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500

    def __init__(self, message: str) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ModelError(MeshError):
    """A model's code failed on purpose (Triton's ``TritonModelException``, a
    ``TritonError`` without a code): INTERNAL, with the model's own message."""


class InvalidArgument(MeshError):
    """The request is wrong; the message names the tensor or field."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class ConfigError(InvalidArgument):
    """A configuration file is wrong; the message names the file and line."""


class NotFound(MeshError):
    """Unknown model, version, or other named thing."""

    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class AlreadyExists(MeshError):
    """A name that must be unique is taken (a shared-memory region registered twice)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class Overloaded(MeshError):
    """A bounded queue is full, or a rate limit applies."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class Unavailable(MeshError):
    """Not ready yet, draining, or a stage cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class RequestTimeout(Unavailable):
    """A request waited in a queue longer than its timeout (REJECT action)."""


class DeadlineExceeded(MeshError):
    """The caller's deadline passed before the work finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class Cancelled(MeshError):
    """The caller cancelled the request."""

    code = grpc.StatusCode.CANCELLED
    http_status = 499


class Unimplemented(MeshError):
    """An RPC or feature this server does not provide."""

    code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501


class FailedPrecondition(MeshError):
    """The system is not in a state that allows the operation."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409


GENERIC_INTERNAL_MESSAGE = "internal error; the server log has the details"


def error_for_status(code: grpc.StatusCode, message: str) -> MeshError:
    """The MeshError class that carries ``code`` (a remote status re-raised here)."""
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        Overloaded,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Unimplemented,
        FailedPrecondition,
    ):
        if cls.code == code:
            return cls(message)
    return MeshError(message)
