"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

from deltaserve.server.protocol import ErrorInfo, ErrorResponse

# HTTP status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_overloaded",
}


class OpenAIError(Exception):
    """An error that one request gets as an OpenAI-style JSON body; the server keeps serving."""

    counted = False  # already in the requests-by-outcome metric

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


class BadRequest(OpenAIError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, 400, param)


class QueueFullError(OpenAIError):
    def __init__(self, max_waiting: int) -> None:
        super().__init__(
            f"the server is overloaded: the waiting queue is full ({max_waiting} requests); "
            "retry later",
            503,
        )


class EngineError(OpenAIError):
    """The engine failed while running a request (a bug, not bad input)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 500)


class EngineShutdownError(OpenAIError):
    def __init__(self) -> None:
        super().__init__("the server is shutting down", 503)


def error_body(message: str, status: int, param: str | None = None) -> ErrorResponse:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    if not message:
        message = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "error"
    return JSONResponse(error_body(message, status, param).model_dump(), status_code=status)
