"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with a matching HTTP status."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any


_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.err_type)


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type or _TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)
