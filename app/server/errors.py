"""The server's errors as OpenAI's API gives them: an error object and its HTTP status."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class APIError(Exception):
    """An OpenAI-style error object and its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        close: bool = False,  # the body was not read: the connection cannot take another request
    ):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param, "code": code}}
        self.headers = {"Connection": "close"} if close else None

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down: send the request to a running server", kind="server_error")


async def api_error(request: Request, exc: Exception) -> Response:
    return exc.response()  # type: ignore[attr-defined]


async def http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code  # type: ignore[attr-defined]
    message = {404: f"no such endpoint: {request.url.path}", 405: f"{request.method} is not allowed here"}
    return APIError(status, message.get(status, str(exc))).response()
