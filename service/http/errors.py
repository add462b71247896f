"""One table from errors to HTTP responses, in the OpenAI error shape; no traceback leaves the pod."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cachestore.errors import ConfigError, StoreError

log = logging.getLogger("kvstash.service")


class ApiError(Exception):
    """An error the client caused or must handle; becomes `status` with a JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(message: str) -> ApiError:
    return ApiError(404, message, code="not_found")


def overloaded(message: str, retry_after_s: int = 1) -> ApiError:
    return ApiError(503, message, type_="server_error", code="overloaded",
                    headers={"Retry-After": str(retry_after_s)})


def redis_unavailable() -> ApiError:
    """Session storage (Redis) failed, timed out or is paused: the client retries."""
    return ApiError(503, "session storage (Redis) is unavailable; retry shortly", type_="server_error",
                    code="redis_unavailable", headers={"Retry-After": "2"})


def session_conflict(session_id: str) -> ApiError:
    """A server-side session's compare-and-set lost: another request changed it while this reply was generated."""
    return ApiError(409, f"session {session_id!r} was changed by another request while this reply was generated; "
                    "the reply was not recorded, read the session and retry", code="session_conflict")


def error_body(status: int, message: str, type_: str, code: str | None, param: str | None) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code or str(status)}}


def _json(exc: ApiError) -> JSONResponse:
    body = error_body(exc.status, exc.message, exc.type, exc.code, exc.param)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _json(exc)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _json(ApiError(exc.status_code, str(exc.detail), type_=type_, code=str(exc.status_code),
                          headers=dict(exc.headers or {})))


async def store_error_handler(request: Request, exc: Exception) -> Response:
    return _json(ApiError(400, str(exc), code="store_refused"))


async def config_error_handler(request: Request, exc: Exception) -> Response:
    return _json(ApiError(400, str(exc), code="invalid_value"))


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _json(ApiError(500, "internal error; the request was not completed", type_="server_error",
                          code="internal_error"))


EXCEPTION_HANDLERS = {
    ApiError: api_error_handler,
    HTTPException: http_exception_handler,
    StoreError: store_error_handler,
    ConfigError: config_error_handler,
    Exception: unexpected_error_handler,
}
