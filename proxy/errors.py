"""Errors in the OpenAI error shape, and the one middleware that maps exceptions to responses.

Exception tree::

    ApiError                 an answer kvkeeper gives on purpose (status + OpenAI error body)
    ├── BadRequest           400 invalid_request_error (bad hint, bad JSON, limits)
    ├── Unauthorized         401 authentication_error
    ├── NotFound             404 not_found_error
    ├── PayloadTooLarge      413 invalid_request_error
    ├── StoreUnavailable     503 (admin calls while Redis is down)
    └── UpstreamError        502/503/504 when no engine could answer
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

log = logging.getLogger("kvkeeper.errors")


class ApiError(Exception):
    """An error answered to the client as ``{"error": {...}}``."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"


class NotFound(ApiError):
    status = 404
    type = "not_found_error"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"


class StoreUnavailable(ApiError):
    status = 503
    type = "service_unavailable"


class UpstreamError(ApiError):
    type = "upstream_error"

    def __init__(self, message: str, *, status: int = 502, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.status = status


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The single place where exceptions become HTTP answers."""
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
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
