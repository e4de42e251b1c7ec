"""Every admin answer (and the probes' and a management request's) from a running kvkeeper
(simulator engine, real Redis) is exactly its pydantic model and valid against the OpenAPI
document's schema for that route."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
from pydantic import BaseModel

from proxy.admin_models import (
    EngineList,
    Health,
    ManagementResult,
    Readiness,
    SessionPage,
    SessionView,
)
from proxy.console_models import Freed, OperationOutcome
from proxy.errors import Error
from tests.helpers.redis_server import RedisServer
from tests.integration.console_fixtures import (
    ADMIN,
    KEYS,
    TREE,
    ConsoleStack,
    console_stack,
    tokens,
)

MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m
    for m in (
        SessionPage,
        SessionView,
        EngineList,
        Freed,
        OperationOutcome,
        Health,
        Readiness,
        ManagementResult,
        Error,
    )
}
SPARSE = (OperationOutcome, Readiness, ManagementResult)  # leave out what does not apply


def _conforms(doc: dict[str, Any], route: str, method: str, status: int, body: Any) -> BaseModel:
    """``body`` as its model, after checking that it is exactly that model and valid against
    the schema the document gives ``route``'s answer with ``status``."""
    schema = doc["paths"][route][method.lower()]["responses"][str(status)]["content"]
    schema = schema["application/json"]["schema"]
    jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).validate(body)
    refs = [schema, *schema.get("anyOf", ())]
    name = next(r["$ref"] for r in refs if "$ref" in r).rsplit("/", 1)[1]
    model = MODELS[name]
    parsed = model.model_validate(body)
    # exactly the model: no key it lacks, none missing, same values
    assert parsed.model_dump(mode="json", exclude_none=model in SPARSE) == body
    return parsed


async def _checked(
    st: ConsoleStack, doc: dict[str, Any], method: str, route: str, path: str, **params: str
) -> tuple[BaseModel, dict[str, Any]]:
    """The admin answer to ``method path``, checked by ``_conforms``."""
    status, body = await st.admin(method, path, **params)
    assert status == 200, body
    return _conforms(doc, route, method, status, body), body


async def test_admin_answers_are_their_models_and_match_the_document(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    async with console_stack(redis_server.url, namespace, tmp_path, tier=True) as st:
        doc = await (await st.client.get("/openapi.json")).json()

        # paged (by session id; only the shape is checked here, tests/integration/test_session_paging.py
        # checks the order)
        first, _ = await _checked(st, doc, "GET", "/admin/sessions", "/admin/sessions", limit="3")
        assert isinstance(first, SessionPage) and len(first.data) == 3
        assert first.next_cursor is not None
        nxt, _ = await _checked(
            st,
            doc,
            "GET",
            "/admin/sessions",
            "/admin/sessions",
            limit="3",
            cursor=first.next_cursor,
        )
        assert isinstance(nxt, SessionPage) and nxt.data
        whole, _ = await _checked(st, doc, "GET", "/admin/sessions", "/admin/sessions")
        assert isinstance(whole, SessionPage) and whole.next_cursor is None
        assert sorted(s.session_id for s in whole.data) == sorted(sid for _, sid, *_ in TREE)
        assert {s.tenant for s in whole.data} == {"a", "b"}

        one, body = await _checked(
            st, doc, "GET", "/admin/sessions/{session_id}", "/admin/sessions/lead-a", tenant="a"
        )
        assert isinstance(one, SessionView)
        assert (one.session_id, one.tenant, one.agent) == ("lead-a", "a", "planner")
        assert one.counters.requests >= 1 and one.counters.prompt_tokens > 0
        kids = {c.session_id: c for c in one.tree.children}
        assert set(kids) == {"a-w1", "a-w2"} and kids["a-w1"].children[0].session_id == "a-w1-x"
        assert one.residency is not None and one.residency.blocks > 0
        assert set(one.residency.engines) == {one.engine}
        assert body["residency"]["engines"][one.engine]["resident_prefix_blocks"]["GPU"] > 0

        engines, _ = await _checked(st, doc, "GET", "/admin/engines", "/admin/engines")
        assert isinstance(engines, EngineList) and len(engines.data) == 1
        e = engines.data[0]
        assert e.healthy and e.events and e.hash_check is not None
        assert e.retention is not None and e.retention.offload_tier
        assert e.retention.tier_pinned is not None and e.retention.guard is not None
        assert e.retention.mode in ("events", "feedback") and e.retention.block_size > 0

        # the actions the console calls answer their models too
        op, _ = await _checked(
            st,
            doc,
            "POST",
            "/admin/sessions/{session_id}/{op}",
            "/admin/sessions/job-1/offload",
            tenant="a",
        )
        assert isinstance(op, OperationOutcome) and op.operation == "offload"
        freed, _ = await _checked(
            st, doc, "DELETE", "/admin/sessions/{session_id}", "/admin/sessions/job-2", tenant="a"
        )
        assert isinstance(freed, Freed) and freed.freed == ["job-2"]

        # errors too: a malformed cursor (400) and an unknown session (404)
        status, body = await st.admin("GET", "/admin/sessions", cursor="not-a-cursor")
        bad = _conforms(doc, "/admin/sessions", "GET", status, body)
        assert status == 400 and isinstance(bad, Error) and bad.error.param == "cursor"
        status, body = await st.admin("GET", "/admin/sessions/nobody", tenant="a")
        gone = _conforms(doc, "/admin/sessions/{session_id}", "GET", status, body)
        assert status == 404 and isinstance(gone, Error) and gone.error.message


async def test_without_retention_the_answers_say_so(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    async with console_stack(redis_server.url, namespace, tmp_path, retention=False) as st:
        doc = await (await st.client.get("/openapi.json")).json()
        one, body = await _checked(
            st, doc, "GET", "/admin/sessions/{session_id}", "/admin/sessions/lead-b", tenant="b"
        )
        assert isinstance(one, SessionView) and one.residency is None
        assert body["residency"] is None and body["tree"]["children"][0]["session_id"] == "b-w1"
        engines, _ = await _checked(st, doc, "GET", "/admin/engines", "/admin/engines")
        assert isinstance(engines, EngineList) and engines.data[0].retention is None


async def test_probes_and_management_answers_match_the_document(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    async with console_stack(redis_server.url, namespace, tmp_path) as st:
        doc = await (await st.client.get("/openapi.json")).json()
        resp = await st.client.get("/healthz")
        assert isinstance(_conforms(doc, "/healthz", "GET", 200, await resp.json()), Health)
        resp = await st.client.get("/readyz")
        ready = _conforms(doc, "/readyz", "GET", resp.status, await resp.json())
        assert isinstance(ready, Readiness) and ready.ready and ready.redis
        assert ready.engines is None  # engine addresses only for the admin
        resp = await st.client.get("/readyz", headers={"Authorization": f"Bearer {ADMIN}"})
        ready = _conforms(doc, "/readyz", "GET", resp.status, await resp.json())
        assert isinstance(ready, Readiness) and ready.engines and all(ready.engines.values())

        edits = [{"type": "prefetch"}, {"type": "evict", "block_start": 0, "block_end": 2}]
        hint = {"session_id": "job", "context_management": {"manage_request": True, "edits": edits}}
        body = {"model": "sim", "prompt": tokens(1), "max_tokens": 1, "agent_hint": hint}
        resp = await st.client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS['a']}"}
        )
        assert resp.status == 200
        got = _conforms(doc, "/v1/completions", "POST", 200, await resp.json())
        assert isinstance(got, ManagementResult) and got.session_id == "job"
        assert [(r.type, r.block_start) for r in got.results] == [("prefetch", None), ("evict", 0)]
