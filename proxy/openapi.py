"""The OpenAPI 3.1 document for kvkeeper's own routes (admin + health + metrics).

The proxied engine routes are described by the engines' own APIs; they are listed here with the
hint fields kvkeeper adds. ``tests/integration`` checks that this document and the router agree.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from proxy.admin_models import (
    EngineList,
    Health,
    ManagementResult,
    Readiness,
    SessionPage,
    SessionView,
)
from proxy.console_models import (
    ConsoleEngines,
    ForestPage,
    Freed,
    OperationOutcome,
    SessionDetail,
)
from proxy.errors import Error
from proxy.hint_schema import AgentHintParams

# models the admin and console handlers return: their schemas go to components/schemas
_MODELS: tuple[type[BaseModel], ...] = (
    SessionPage,
    SessionView,
    EngineList,
    Health,
    Readiness,
    ManagementResult,
    ForestPage,
    ConsoleEngines,
    SessionDetail,
    Freed,
    OperationOutcome,
    Error,
)

_ERROR = {"$ref": "#/components/schemas/Error"}
_SID = {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
_TENANT = {
    "name": "tenant",
    "in": "query",
    "required": False,
    "schema": {"type": "string"},
    "description": "Operator token only: the tenant to act on (default: 'default').",
}


def _resp(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"description": description}
    if schema is not None:
        body["content"] = {"application/json": {"schema": schema}}
    return body


def _errors(*codes: int) -> dict[str, Any]:
    names = {400: "Bad request", 401: "Unauthorized", 404: "Not found", 503: "Store unavailable"}
    return {str(c): _resp(names[c], _ERROR) for c in codes}


def _proxied(summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "description": "Forwarded to an engine byte for byte; hint fields are stripped first.",
            "parameters": [
                {"name": h, "in": "header", "required": False, "schema": {"type": "string"}}
                for h in ("X-Session-Id", "X-Parent-Session-Id", "X-Agent-Name", "X-Cache-TTL")
            ],
            "requestBody": {
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "agent_hint": {"$ref": "#/components/schemas/AgentHint"}
                            },
                            "additionalProperties": True,
                        }
                    }
                }
            },
            "responses": {
                "200": _resp(
                    "The engine's response (JSON or SSE), or, for a manage_request hint, the "
                    "management result",
                    {"anyOf": [_ref(ManagementResult), {"description": "the engine's answer"}]},
                ),
                **_errors(400, 401),
                "502": _resp("No engine could take the request", _ERROR),
            },
        }
    }


def _relayed() -> dict[str, Any]:
    """The catch-all (proxy/passthrough.py): every other engine route, relayed unchanged."""
    op = {
        "summary": "Any other engine route (count_tokens, /v1/models/{id}, /v1/embeddings, "
        "/tokenize, /detokenize, /health, /version, /v1/responses/{id} ...), relayed byte for "
        "byte to one engine: a hinted request to its session's engine, a stored response's id "
        "to the engine that holds it, else the least loaded engine",
        "parameters": [
            {"name": "tail", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
        "responses": {
            "200": _resp("The engine's answer, unchanged (any status)"),
            "502": _resp("No engine could take the request", _ERROR),
        },
    }
    return {m: op for m in ("get", "post", "put", "patch", "delete")}


def _ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _model_schemas() -> dict[str, Any]:
    """The handlers' pydantic models as component schemas (their nested models hoisted)."""
    out: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in (*schema.pop("$defs", {}).items(), (model.__name__, schema)):
            if out.setdefault(name, sub) != sub:  # two models of one name would shadow
                raise RuntimeError(f"two different schemas named {name}")
    return out


def _ui_paths() -> dict[str, Any]:
    """The operator console: its pages, and the admin JSON only it reads."""
    page = {"get": {"summary": "The operator console (HTML, no auth: it asks for a token)"}}
    html = {"200": {"description": "A page", "content": {"text/html": {"schema": {}}}}}
    get: dict[str, Any] = {"security": [{"bearer": []}]}
    return {
        "/ui": {"get": {**page["get"], "responses": {"302": _resp("Redirect to /ui/")}}},
        "/ui/": {"get": {**page["get"], "responses": html}},
        "/ui/{name}": {
            "get": {
                "summary": "A file of the console (index.html, console.js, console.css)",
                "parameters": [
                    {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {"200": _resp("The file"), "404": _resp("No such file")},
            }
        },
        "/admin/console/forest": {
            "get": {
                **get,
                "summary": "One page of whole session trees, searchable by id, agent or parent",
                "parameters": [
                    _TENANT,
                    *(
                        {"name": n, "in": "query", "required": False, "schema": sch}
                        for n, sch in (
                            ("q", {"type": "string"}),
                            (
                                "state",
                                {
                                    "enum": [
                                        "active",
                                        "protected",
                                        "idle",
                                        "offloaded",
                                        "expired",
                                    ]
                                },
                            ),
                            ("offset", {"type": "integer", "minimum": 0}),
                            ("limit", {"type": "integer", "minimum": 1, "maximum": 200}),
                        )
                    ),
                ],
                "responses": {
                    "200": _resp("Trees whose sessions match", _ref(ForestPage)),
                    **_errors(400, 401, 503),
                },
            }
        },
        "/admin/console/sessions/{session_id}": {
            "get": {
                **get,
                "summary": "One session with its children and its prefix's residency per engine",
                "parameters": [_SID, _TENANT],
                "responses": {
                    "200": _resp("The session", _ref(SessionDetail)),
                    **_errors(401, 404, 503),
                },
            }
        },
        "/admin/console/engines": {
            "get": {
                **get,
                "summary": "Per engine: health, load, horizon, credit, touches, tier pins, series",
                "responses": {
                    "200": _resp("Engines with their recent series", _ref(ConsoleEngines)),
                    **_errors(401),
                },
            }
        },
    }


def document() -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/v1/chat/completions": _proxied("OpenAI chat completions"),
        "/v1/completions": _proxied("OpenAI completions"),
        "/v1/messages": _proxied("Anthropic messages"),
        "/v1/responses": _proxied("OpenAI responses"),
        "/v1/models": {
            "get": {"summary": "Models merged across engines", "responses": {"200": _resp("List")}}
        },
        "/healthz": {
            "get": {"summary": "Liveness", "responses": {"200": _resp("Alive", _ref(Health))}}
        },
        "/{tail}": _relayed(),
        "/readyz": {
            "get": {
                "summary": "Readiness: at least one engine healthy",
                "responses": {
                    "200": _resp("Ready", _ref(Readiness)),
                    "503": _resp("Not ready", _ref(Readiness)),
                },
            }
        },
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": _resp("Text")}}},
        "/openapi.json": {
            "get": {"summary": "This document", "responses": {"200": _resp("OpenAPI")}}
        },
        "/admin/sessions": {
            "get": {
                "summary": "List sessions by tenant, then session id",
                "description": (
                    "Pages run over tenants by name, then each tenant's sessions by id (code"
                    " point order), so sessions used while a client pages do not move: each"
                    " session that exists throughout appears exactly once. next_cursor is"
                    " opaque and valid only for the listing it came from (same tenant scope,"
                    " parent and state); an altered or foreign cursor is a 400 (param cursor)."
                    " Omit cursor (or pass it empty) for the first page."
                ),
                "security": [{"bearer": []}],
                "parameters": [
                    _TENANT,
                    *(
                        {"name": n, "in": "query", "required": False, "schema": {"type": t}}
                        for n, t in (
                            ("parent", "string"),
                            ("state", "string"),
                            ("cursor", "string"),
                            ("limit", "integer"),
                        )
                    ),
                ],
                "responses": {
                    "200": _resp("A page of sessions", _ref(SessionPage)),
                    **_errors(400, 401, 503),
                },
            }
        },
        "/admin/sessions/{session_id}": {
            "get": {
                "summary": "One session with its subtree, TTL left, engine and counters",
                "security": [{"bearer": []}],
                "parameters": [_SID, _TENANT],
                "responses": {
                    "200": _resp("The session", _ref(SessionView)),
                    **_errors(401, 404, 503),
                },
            },
            "delete": {
                "summary": "Free a session; ?tree=true frees its subtree, children first",
                "security": [{"bearer": []}],
                "parameters": [
                    _SID,
                    _TENANT,
                    {
                        "name": "tree",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "boolean"},
                    },
                ],
                "responses": {
                    "200": _resp("Freed ids in the order they were freed", _ref(Freed)),
                    **_errors(401, 404, 503),
                },
            },
        },
        "/admin/sessions/{session_id}/{op}": {
            "post": {
                "summary": "pin | offload | prefetch | evict one session (optional block range)",
                "security": [{"bearer": []}],
                "parameters": [
                    _SID,
                    {
                        "name": "op",
                        "in": "path",
                        "required": True,
                        "schema": {"enum": ["pin", "offload", "prefetch", "evict"]},
                    },
                    _TENANT,
                ],
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "block_start": {"type": "integer", "minimum": 0},
                                    "block_end": {"type": "integer", "minimum": 1},
                                    "ttl": {"type": "number", "exclusiveMinimum": 0},
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": _resp(
                        "applied / unsupported / rejected / failed, with detail",
                        _ref(OperationOutcome),
                    ),
                    **_errors(400, 401, 404, 503),
                },
            }
        },
        "/admin/engines": {
            "get": {
                "summary": "Engines with health and load",
                "security": [{"bearer": []}],
                "responses": {
                    "200": _resp("Engines with their retention state", _ref(EngineList)),
                    **_errors(401),
                },
            }
        },
        **_ui_paths(),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvkeeper", "version": "0.1.0"},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                **_model_schemas(),
                "AgentHint": AgentHintParams.model_json_schema(
                    ref_template="#/components/schemas/AgentHint/$defs/{model}"
                ),
            },
        },
    }
