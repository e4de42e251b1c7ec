"""Workload generators, trace parsing, token content and hint construction (pure, no I/O)."""

from __future__ import annotations

import itertools
import json
import lzma
import shutil
from pathlib import Path

import pytest

from loadgen import tokens
from loadgen.runner import render_messages
from loadgen.workloads import build_workload, load_spec, make_params, parse_overrides
from loadgen.workloads.base import Call, Segment, Spawn, Workload, sized
from loadgen.workloads.hints import HintPolicy, call_hints, manage_body
from loadgen.workloads.trace import SHIPPED_TRACES, TRACE_DIR_ENV

TRACES = SHIPPED_TRACES


def _ids(call: Call) -> list[int]:
    return tokens.render_ids(call.pieces())


def _is_prefix(a: list[int], b: list[int]) -> bool:
    return b[: len(a)] == a


@pytest.mark.parametrize("name", ["swarm", "fanout", "multiturn", "cachescout"])
def test_same_seed_same_workload_other_seed_differs(name: str) -> None:
    a, b = build_workload(name, {"seed": 3}), build_workload(name, {"seed": 3})
    c = build_workload(name, {"seed": 4})
    assert a == b
    assert a.sessions != c.sessions
    assert [_ids(x) for x in a.calls()] == [_ids(x) for x in b.calls()]


def test_swarm_calls_open_with_their_agents_anchor() -> None:
    wl = build_workload("swarm", {"users": 10, "agents": 6})
    anchors: dict[str, Segment] = {}
    for call in wl.calls():
        head = call.prompt[0]
        assert head.namespace == f"shared/anchor/{call.agent}" and head.role == "system"
        assert anchors.setdefault(str(call.agent), head) == head  # one anchor per agent
        assert 2000 <= head.n_tokens <= 8000
    assert len(anchors) == 7  # supervisor + 6 agents
    for s in wl.sessions:  # each session: tool calls, then the final end_turn
        stops = [c.stop for c in s.steps if isinstance(c, Call)]
        assert stops[-1] == "end_turn" and set(stops[:-1]) <= {"tool_use"}
        assert s.steps[0].agent == "supervisor"  # type: ignore[union-attr]


def test_swarm_history_grows_within_a_session() -> None:
    wl = build_workload("swarm", {"users": 3})
    for s in wl.sessions:
        calls = [c for c in s.steps if isinstance(c, Call)]
        for prev, cur in itertools.pairwise(calls):
            assert prev.prompt[1:] == cur.prompt[1 : len(prev.prompt)]
            assert (
                cur.prompt_tokens - cur.prompt[0].n_tokens
                > prev.prompt_tokens - prev.prompt[0].n_tokens
            )


def test_cachescout_matches_its_evaluation_setting() -> None:
    """Six agents, supervisor between dispatches, 16-token blocks, a ~93-block largest request,
    fixed three-part agent contexts, and each agent's own view growing by prefix."""
    wl = build_workload("cachescout", {})
    assert wl.block_tokens == 16
    calls = list(wl.calls())
    assert {c.agent for c in calls} == {
        "supervisor", "researcher", "coder", "analyst", "writer", "reviewer",
    }  # fmt: skip
    assert 85 <= max(c.prompt_tokens for c in calls) / 16 <= 100
    heads: dict[str, tuple[Segment, ...]] = {}
    for call in calls:
        head = call.prompt[:3]
        assert [seg.namespace.rsplit("/", 1)[1] for seg in head] == ["system", "tools", "fewshot"]
        assert heads.setdefault(str(call.agent), head) == head  # one fixed context per agent
    for s in wl.sessions:
        steps = [c for c in s.steps if isinstance(c, Call)]
        assert steps[0].agent == steps[-1].agent == "supervisor"
        assert steps[-1].stop == "end_turn"
        last: dict[str, Call] = {}
        for prev, cur in itertools.pairwise(steps):
            # the supervisor routes every dispatch (an agent may call twice, a tool between)
            assert prev.agent == cur.agent or "supervisor" in (prev.agent, cur.agent)
        for cur in steps:  # an agent's (or the supervisor's) next call extends its last prompt
            before = last.get(str(cur.agent))
            if before is not None:
                assert cur.prompt[: len(before.prompt)] == before.prompt
            last[str(cur.agent)] = cur


def test_fanout_workers_share_the_leaders_context() -> None:
    wl = build_workload("fanout", {"jobs": 2, "workers": 3})
    for job in wl.sessions:
        spawn = next(s for s in job.steps if isinstance(s, Spawn))
        leader_calls = [s for s in job.steps if isinstance(s, Call)]
        built = _ids(leader_calls[2])  # the last build turn's prompt
        assert spawn.wait and len(spawn.children) == 3
        for worker in spawn.children:
            first = worker.steps[0]
            assert isinstance(first, Call)
            assert _is_prefix(built, _ids(first))
        join = leader_calls[3]
        assert _is_prefix(built, _ids(join)) and join.think == 0.0


def test_multiturn_turns_extend_the_previous_prompt() -> None:
    wl = build_workload("multiturn", {"conversations": 4})
    common = None
    for s in wl.sessions:
        calls = [c for c in s.steps if isinstance(c, Call)]
        common = common or calls[0].prompt[0]
        assert calls[0].prompt[0] == common
        for prev, cur in itertools.pairwise(calls):
            assert _is_prefix(_ids(prev), _ids(cur))


def test_claude_code_traces_match_source_md_counts() -> None:
    wl = build_workload("trace", {})
    assert len(wl.sessions) == 48 and wl.api == "completions-ids" and wl.block_tokens == 64
    assert wl.n_calls() == 5111
    subs = [c for s in wl.sessions for st in s.steps if isinstance(st, Spawn) for c in st.children]
    assert len(subs) == 41 and sum(sum(1 for _ in c.calls()) for c in subs) == 486


def test_trace_prompts_keep_sizes_and_think_times() -> None:
    doc = json.loads(lzma.decompress((TRACES / "trace_0291.json.xz").read_bytes()))
    wl = build_workload("trace", {"files": "trace_0291"})
    calls = [s for s in wl.sessions[0].steps if isinstance(s, Call)]
    top = [e for e in doc["requests"] if e.get("type") != "subagent"]
    assert [c.prompt_tokens for c in calls] == [e["in"] for e in top]
    assert [c.think for c in calls[1:5]] == [e["think_time"] for e in top[1:5]]
    # the shared head covers (tool + system) // 64 blocks, mapped onto one namespace
    assert calls[0].prompt[0].namespace == "shared/cc-head/main"
    assert len(calls[0].prompt[0].ids) == (12166 + 3318) // 64
    scaled = build_workload("trace", {"files": "trace_0291", "token_scale": 0.125})
    first = next(iter(scaled.calls()))
    assert scaled.block_tokens == 8 and abs(first.prompt_tokens - 17869 / 8) < 8


def test_trace_without_shared_head_keeps_private_namespaces() -> None:
    wl = build_workload("trace", {"files": "trace_0291,trace_0274", "shared_head": False})
    assert all(not seg.namespace.startswith("shared/") for c in wl.calls() for seg in c.prompt)


def test_trace_dir_from_the_environment_plain_files_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$KVKEEPER_TRACE_DIR replaces the shipped set; a plain file wins over its .xz copy."""
    shutil.copy(TRACES / "trace_0291.json.xz", tmp_path)
    shutil.copy(TRACES / "trace_0274.json.xz", tmp_path)
    doc = json.loads(lzma.decompress((TRACES / "trace_0274.json.xz").read_bytes()))
    doc["requests"] = doc["requests"][:3]  # a different file under the same name
    (tmp_path / "trace_0274.json").write_text(json.dumps(doc))
    (tmp_path / "notes.txt").write_text("not a trace")
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    wl = build_workload("trace", {})
    assert [s.session_id for s in wl.sessions] == ["trace_0274", "trace_0291"]
    plain = build_workload("trace", {"path": str(tmp_path / "trace_0274.json")})
    monkeypatch.delenv(TRACE_DIR_ENV)
    shipped = build_workload("trace", {"files": "trace_0274"})
    assert shipped.params["path"] == str(TRACES)
    assert wl.sessions[0] == plain.sessions[0] != shipped.sessions[0]
    assert wl.params["path"] == str(tmp_path)


def test_trace_names_a_missing_file_or_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no trace_9999 under"):
        build_workload("trace", {"files": "trace_0291,trace_9999"})
    with pytest.raises(ValueError, match="no such trace file or directory"):
        build_workload("trace", {"path": str(tmp_path / "absent")})


def test_mooncake_jsonl(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 2500, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]},
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    wl = build_workload("trace", {"path": str(path)})
    assert wl.block_tokens == 512 and [s.start for s in wl.sessions] == [0.0, 2.5]
    a, b = (next(s.calls()) for s in wl.sessions)
    assert (a.prompt_tokens, b.prompt_tokens, a.max_tokens) == (1100, 600, 10)
    assert _ids(a)[:512] == _ids(b)[:512] and _ids(a)[512:1024] != _ids(b)[512:1024]


def test_token_content_is_stable_and_prefix_closed() -> None:
    assert tokens.block_ids("ns", 7, 32)[:10] == tokens.block_ids("ns", 7, 10)
    assert tokens.block_ids("ns", 7, 32) != tokens.block_ids("ns", 8, 32)
    words = tokens.block_words("ns", 7, 32)
    assert all(1 <= len(w) <= 3 and w.isalpha() for w in words)
    assert tokens.render_text([("ns", 7, 32)]).split() == words
    # pinned values: content must not drift between versions (it keys cached prefixes)
    assert tokens.render_ids([("a", 1, 5)]) == [1081, 1106, 1102, 1051, 1047]


def test_chat_rendering_merges_same_role_segments() -> None:
    seg = [
        sized("shared/s", 4, role="system"),
        sized("x", 3),
        sized("y", 2),
        sized("z", 2, role="assistant"),
    ]
    msgs = render_messages(tuple(seg))
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert len(msgs[1]["content"].split()) == 5


def test_params_from_cli_and_yaml(tmp_path: Path) -> None:
    assert parse_overrides(["users=8", "token_scale=0.5", "path=/x"]) == {
        "users": 8,
        "token_scale": 0.5,
        "path": "/x",
    }
    assert make_params("swarm", {"users": "8"}).users == 8
    assert make_params("trace", {"shared_head": "false"}).shared_head is False
    with pytest.raises(ValueError, match="unknown parameter 'userz'"):
        make_params("swarm", {"userz": 1})
    with pytest.raises(ValueError, match="users must be int"):
        make_params("swarm", {"users": "many"})
    spec = tmp_path / "s.yaml"
    spec.write_text("workload: fanout\nparams:\n  jobs: 2\n  workers: 5\n")
    name, params = load_spec(spec)
    wl = build_workload(name, params)
    assert isinstance(wl, Workload) and len(wl.sessions) == 2


def test_hint_modes() -> None:
    kw = {
        "session_id": "s1",
        "parent_id": "p0",
        "agent": "coder",
        "tool_pause": 30.0,
        "ends_in_tool_call": True,
    }
    none = call_hints(HintPolicy("none"), **kw)  # type: ignore[arg-type]
    assert none.headers == {} and none.body == {}
    sess = call_hints(HintPolicy("session"), **kw)  # type: ignore[arg-type]
    assert sess.headers == {"X-Session-Id": "s1"} and sess.body == {}
    full = call_hints(HintPolicy("full", ttl_cap=45.0), **kw)  # type: ignore[arg-type]
    assert full.headers == {"X-Agent-Name": "coder"}
    assert full.body == {
        "agent_hint": {
            "session_id": "s1",
            "parent_session_id": "p0",
            "cache_control": {"type": "ephemeral", "ttl": 45.0},
        }
    }
    end = call_hints(HintPolicy("full"), **(kw | {"ends_in_tool_call": False}))  # type: ignore[arg-type]
    assert "cache_control" not in end.body["agent_hint"]
    # the end-of-turn TTL experiment: a TTL on calls ending a turn, from a given step on
    turn_ttl = HintPolicy("full", end_turn_ttl=36.0, end_turn_from=1)
    kw_end = kw | {"ends_in_tool_call": False}
    first = call_hints(turn_ttl, **kw_end)  # type: ignore[arg-type]
    assert "cache_control" not in first.body["agent_hint"]
    later = call_hints(turn_ttl, **(kw_end | {"step": 1}))  # type: ignore[arg-type]
    assert later.body["agent_hint"]["cache_control"] == {"type": "ephemeral", "ttl": 36.0}
    assert HintPolicy("full").ttl_for(10.0) == 20.0 and HintPolicy("full").ttl_for(None) == 60.0
    assert HintPolicy("full", ttl_cap=1e9).ttl_for(1e6) == 3600.0
    body = manage_body("m", session_id="s1", parent_id=None, edit="evict")
    assert body["messages"] == [{"role": "user", "content": ""}]
    assert body["agent_hint"]["context_management"] == {
        "manage_request": True,
        "edits": [{"type": "evict"}],
    }


def test_cli_trace_dir_and_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.cli import main

    shutil.copy(TRACES / "trace_0398.json.xz", tmp_path)
    argv = ["bench", "ceiling", "--workload", "trace", "--concurrency", "1", "--capacity", "1.0"]
    assert main([*argv, "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 1 | 946 | 64 | 36 |" in out  # trace_0398 alone: its 36 requests
    assert main([*argv, "--set", "files=trace_9999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvkeeper bench ceiling: error: trace: no trace_9999 under")
    assert len(err.splitlines()) == 1
