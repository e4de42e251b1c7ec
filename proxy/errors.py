"""Errors in the OpenAI error shape, and the one middleware that maps exceptions to responses.

Exception tree::

    ApiError                 an answer kvkeeper gives on purpose (status + OpenAI error body)
    ├── BadRequest           400 invalid_request_error (bad hint, bad JSON, limits)
    ├── Unauthorized         401 authentication_error
    ├── Forbidden            403 permission_error (a tenant acting on another tenant)
    ├── NotFound             404 not_found_error
    ├── RequestTimeout       408 (the body did not arrive in time; the connection closes)
    ├── PayloadTooLarge      413 invalid_request_error
    ├── StoreUnavailable     503 (admin calls while Redis is down)
    └── UpstreamError        502/503/504 when no engine could answer
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic import BaseModel

log = logging.getLogger("kvkeeper.errors")


class ErrorDetail(BaseModel):
    """What went wrong (OpenAI's error object)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class Error(BaseModel):
    """kvkeeper's error answer on its own and the OpenAI routes: ``{"error": {...}}``."""

    error: ErrorDetail


class ApiError(Exception):
    """An error answered to the client as ``{"error": {...}}``."""

    status = 500
    type = "server_error"
    close = False  # close the connection after the answer (a request body left unread)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return Error(error=detail).model_dump(mode="json")


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"


class Forbidden(ApiError):
    status = 403
    type = "permission_error"


class RequestTimeout(ApiError):
    status = 408
    type = "invalid_request_error"
    close = True


class NotFound(ApiError):
    status = 404
    type = "not_found_error"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    close = True


class ServerBusy(ApiError):
    status = 503
    type = "service_unavailable"


class StoreUnavailable(ApiError):
    status = 503
    type = "service_unavailable"


class UpstreamError(ApiError):
    type = "upstream_error"

    def __init__(self, message: str, *, status: int = 502, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.status = status


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_ROUTES = ("/v1/messages",)  # and below it (/v1/messages/count_tokens)


def anthropic_body(err: ApiError) -> dict[str, Any]:
    """The error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    default = "api_error" if err.status >= 500 else "invalid_request_error"
    kind = _ANTHROPIC_TYPES.get(err.status, default)
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def is_anthropic(path: str) -> bool:
    return any(path == r or path.startswith(r + "/") for r in ANTHROPIC_ROUTES)


def error_response(err: ApiError, *, anthropic: bool = False) -> web.Response:
    """The error in the client's dialect: Anthropic's shape on its routes, else OpenAI's."""
    resp = web.json_response(anthropic_body(err) if anthropic else err.body(), status=err.status)
    if err.close:
        resp.force_close()
    return resp


_in_dialect = error_response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The single place where exceptions become HTTP answers."""
    # every answer below in the dialect of the route (a local name: one rule for every branch)
    error_response = functools.partial(_in_dialect, anthropic=is_anthropic(request.path))
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPRequestEntityTooLarge:  # a chunked body grew past the limit while read
        return error_response(
            PayloadTooLarge("request body is larger than the limit", code="body_too_large")
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = BadRequest if exc.status < 500 else ApiError
        mapped = kind(exc.reason or "error", code=str(exc.status))
        mapped.status = exc.status
        return error_response(mapped)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # the last line of defence: never leak a traceback to the client
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError("internal error", code="internal_error"))
