"""Domain errors the servicers raise; ``server.status_for`` maps them to gRPC status codes.

ValueError (a bad request, naming the field) → INVALID_ARGUMENT; ModelNotFound → NOT_FOUND;
Overloaded → RESOURCE_EXHAUSTED;
Unavailable → UNAVAILABLE; RequestFailed → INTERNAL with its message; anything else → INTERNAL with a generic
message.
"""


class Overloaded(RuntimeError):
    """The queue is full: retry later."""


class Unavailable(RuntimeError):
    """A dependency (worker, scheduler) is gone or draining."""


class Precondition(RuntimeError):
    """The request asks for something this replica is not set up for (FAILED_PRECONDITION)."""


class RequestFailed(RuntimeError):
    """The engine failed this one request (e.g. its structured-output grammar failed on the worker:
    ``constraint.grammar: ...``); the service stays healthy. INTERNAL with this message, never moved to
    another replica."""


class ModelNotFound(ValueError):
    """The request names a model this deployment does not serve."""
