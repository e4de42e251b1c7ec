"""The ``mooncake`` workload: trace parsing, conversations from the prefix structure, prompts."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from loadgen import ceiling, tokens
from loadgen.workloads import build_workload
from loadgen.workloads.base import Call
from loadgen.workloads.mooncake import (
    DEFAULT_TRACE,
    MooncakeParams,
    Request,
    conversations,
    read_requests,
    select,
)


def line(t_ms: int, n_in: int, ids: list[int], n_out: int = 10) -> dict[str, object]:
    return {"timestamp": t_ms, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


# Conversation 0: A, C, E (each extends every complete block of the one before); B and D share
# only block 0 with anyone; F is a whole number of blocks, so G extends all of it.
LINES = [
    line(0, 1100, [0, 1, 2]),  # A: complete blocks [0, 1]
    line(500, 600, [0, 3]),  # B: complete [0]: nothing can continue it
    line(2000, 2000, [0, 1, 4, 5]),  # C: continues A
    line(2500, 1100, [0, 3, 9]),  # D: shares [0, 3] with B, but B has one complete block
    line(4000, 2100, [0, 1, 4, 6, 7]),  # E: continues C (prefix [0, 1, 4]; A's [0, 1] is shorter)
    line(4500, 1024, [0, 8]),  # F
    line(6000, 1300, [0, 8, 10], n_out=7),  # G: continues F
]


def write(path: Path, lines: list[dict[str, object]]) -> Path:
    text = "".join(json.dumps(x) + "\n" for x in lines)
    if path.suffix == ".xz":
        path.write_bytes(lzma.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def ids(call: Call) -> list[int]:
    return tokens.render_ids(call.pieces())


def test_read_requests_plain_and_xz(tmp_path: Path) -> None:
    shuffled = [LINES[2], LINES[0], LINES[1]]
    for name in ("t.jsonl", "t.jsonl.xz"):
        reqs = read_requests(write(tmp_path / name, shuffled))
        assert [r.t for r in reqs] == [0.0, 0.5, 2.0]  # seconds, in arrival order
        assert reqs[0] == Request(0.0, 1100, 10, (0, 1, 2))


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ('{"timestamp": 0, "input_length": 5}', "line 2: not a trace record"),
        ("not json", "line 2: not a trace record"),
        (json.dumps(line(0, 600, [0, 1, 2])), "line 2: more hash_ids than 512-token blocks"),
        (json.dumps(line(0, 0, [])), "line 2: input_length must be >= 1"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, bad: str, error: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(LINES[0]) + "\n" + bad + "\n")
    with pytest.raises(ValueError, match=error):
        read_requests(path)


def test_complete_blocks_leave_out_a_partial_last_block() -> None:
    assert Request(0, 1100, 1, (0, 1, 2)).complete_blocks() == (0, 1)
    assert Request(0, 1024, 1, (0, 8)).complete_blocks() == (0, 8)


def test_conversations_follow_the_prefix_structure(tmp_path: Path) -> None:
    reqs = read_requests(write(tmp_path / "t.jsonl", LINES))
    assert conversations(reqs) == [0, 1, 0, 2, 0, 3, 3]


def test_the_workload_plays_conversations_at_their_times(tmp_path: Path) -> None:
    wl = build_workload("mooncake", {"path": str(write(tmp_path / "t.jsonl", LINES))})
    assert wl.name == "mooncake" and wl.block_tokens == 512 and wl.api == "completions-ids"
    assert [s.session_id for s in wl.sessions] == ["mc-0", "mc-1", "mc-2", "mc-3"]
    assert [s.start for s in wl.sessions] == [0.0, 0.5, 2.5, 4.5]
    a, c, e = wl.sessions[0].steps
    assert isinstance(a, Call) and isinstance(c, Call) and isinstance(e, Call)
    assert [(x.at, x.think) for x in (a, c, e)] == [(0.0, 0.0), (2.0, 2.0), (4.0, 2.0)]
    assert [x.prompt_tokens for x in (a, c, e)] == [1100, 2000, 2100]
    assert a.max_tokens == 10 and wl.sessions[3].steps[1].max_tokens == 7  # type: ignore[union-attr]
    # equal hash ids are equal token blocks, a different id different tokens; a partial last
    # block is the first tokens of that id's block
    assert ids(a)[:1024] == ids(c)[:1024] and ids(c)[:1536] == ids(e)[:1536]
    assert ids(a)[1024:1100] != ids(c)[1024:1100]
    (d,) = wl.sessions[2].steps
    assert (
        isinstance(d, Call)
        and ids(d)[:512] == ids(a)[:512]
        and ids(d)[512:1024] != ids(a)[512:1024]
    )
    # the offline ceiling holds a turn until the one before it finished
    timeline = ceiling.play(wl.sessions[0], service=lambda call: 3.0)
    assert [tc.arrival for tc in timeline.calls] == [0.0, 3.0, 6.0]


def test_the_same_parameters_build_the_same_workload(tmp_path: Path) -> None:
    path = str(write(tmp_path / "t.jsonl", LINES))
    one, two = (build_workload("mooncake", {"path": path, "scale": 0.25}) for _ in range(2))
    assert one == two
    assert [ids(c) for c in one.calls()] == [ids(c) for c in two.calls()]


def test_scale_divides_every_length(tmp_path: Path) -> None:
    wl = build_workload(
        "mooncake", {"path": str(write(tmp_path / "t.jsonl", LINES)), "scale": 0.25}
    )
    assert wl.block_tokens == 128
    calls = list(wl.sessions[0].calls())
    assert [c.prompt_tokens for c in calls] == [275, 500, 525]
    assert [c.max_tokens for c in calls] == [2, 2, 2]  # 10 tokens x 0.25, rounded
    assert ids(calls[0])[:256] == ids(calls[1])[:256]


def test_window_thinning_and_cap(tmp_path: Path) -> None:
    reqs = read_requests(write(tmp_path / "t.jsonl", LINES))
    # the window renumbers conversations: A is outside, so C starts one (and E continues it)
    window = select(reqs, MooncakeParams(start=1.0, duration=4.0))
    assert [(c, r.t) for c, r in window] == [(0, 2.0), (1, 2.5), (0, 4.0), (2, 4.5)]
    every = select(reqs, MooncakeParams(every=2))
    assert [c for c, _ in every] == [0, 0, 2, 0]
    assert len(select(reqs, MooncakeParams(max_requests=3))) == 3
    wl = build_workload("mooncake", {"path": str(tmp_path / "t.jsonl"), "start": 1.0})
    assert wl.sessions[0].start == 0.0  # times count from the first kept request


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"every": 0}, "every >= 1"),
        ({"scale": 0}, "scale > 0"),
        ({"start": 100.0}, "no requests in"),
        ({"path": "/nonexistent.jsonl"}, "no such trace file"),
    ],
)
def test_bad_parameters_are_refused(tmp_path: Path, values: dict[str, object], error: str) -> None:
    values = {"path": str(write(tmp_path / "t.jsonl", LINES)), **values}
    with pytest.raises(ValueError, match=error):
        build_workload("mooncake", values)


def test_the_shipped_excerpt() -> None:
    assert DEFAULT_TRACE.stat().st_size < 300_000
    reqs = read_requests(DEFAULT_TRACE)
    assert len(reqs) == 4193 and reqs[-1].t - reqs[0].t < 1200
    wl = build_workload("mooncake", {})
    assert wl.n_calls() == 4193
    continued = sum(len(s.steps) - 1 for s in wl.sessions)
    assert 0.1 < continued / wl.n_calls() < 0.5  # a fair share of the requests are later turns
    small = build_workload("mooncake", {"duration": 600, "every": 8, "max_requests": 100})
    assert small.n_calls() == 100
