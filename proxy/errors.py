"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from aiohttp import web


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,  # int: as vLLM's own answers have it
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        # Close the connection after answering: the request's body was not read (too
        # large, too slow, over budget), so the connection cannot carry another request.
        self.close = close

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        resp = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.close:
            resp.force_close()
        return resp


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def server_error(status: int, message: str, code: str) -> APIError:
    return APIError(
        status, message, "server_error" if status >= 500 else "invalid_request_error", None, code
    )
