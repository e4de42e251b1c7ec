"""The cache-aware dispatch gate: slots, best-first order, the starvation bound, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from proxy.dispatch import DispatchGate


async def _enter_all(
    gate: DispatchGate, costs: list[float], order: list[float]
) -> list[asyncio.Task[None]]:
    async def one(cost: float) -> None:
        ticket = await gate.enter("e", cost)
        order.append(cost)
        await asyncio.sleep(0)
        gate.started(ticket)
        gate.leave(ticket)

    tasks = []
    for c in costs:
        tasks.append(asyncio.create_task(one(c)))
        await asyncio.sleep(0)  # queue them in this order
    return tasks


async def test_fewest_uncached_tokens_go_first_once_the_engine_has_room() -> None:
    gate = DispatchGate(ahead=1, max_wait_s=60)
    first = await gate.enter("e", 1000.0)  # takes the only slot
    order: list[float] = []
    tasks = await _enter_all(gate, [900.0, 10.0, 500.0, 10.0], order)
    assert gate.queued("e") == 4 and gate.held == 4 and order == []
    gate.started(first)  # its first byte: the engine has room for the next
    await asyncio.gather(*tasks)
    assert order == [10.0, 10.0, 500.0, 900.0]  # cheapest first, ties in arrival order
    gate.leave(first)
    assert gate.queued("e") == 0


async def test_a_request_waiting_too_long_goes_next_whatever_its_cost() -> None:
    gate = DispatchGate(ahead=1, max_wait_s=0.05)
    first = await gate.enter("e", 0.0)
    order: list[float] = []
    tasks = await _enter_all(gate, [900.0], order)
    await asyncio.sleep(0.06)
    tasks += await _enter_all(gate, [1.0], order)
    gate.leave(first)
    await asyncio.gather(*tasks)
    assert order == [900.0, 1.0]


async def test_engines_are_independent_and_unheld_requests_only_count() -> None:
    gate = DispatchGate(ahead=1, max_wait_s=60)
    a = await gate.enter("a", 5.0)
    b = await gate.enter("b", 5.0)  # another engine: its own slot
    c = await gate.enter("a", 5.0, hold=False)  # not streamed: never waits, still counted
    waiter = asyncio.create_task(gate.enter("a", 1.0))
    await asyncio.sleep(0)
    gate.leave(a)
    await asyncio.sleep(0)
    assert not waiter.done()  # c still occupies the engine's queue
    gate.started(c)
    ticket = await asyncio.wait_for(waiter, 1)
    for t in (b, c, ticket):
        gate.leave(t)


async def test_cancelled_waiters_leave_no_trace() -> None:
    gate = DispatchGate(ahead=1, max_wait_s=60)
    first = await gate.enter("e", 0.0)
    gone = asyncio.create_task(gate.enter("e", 1.0))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert gate.queued("e") == 0
    # handed the slot and cancelled before it could run: the slot goes to the next one
    handed = asyncio.create_task(gate.enter("e", 1.0))
    nxt = asyncio.create_task(gate.enter("e", 2.0))
    await asyncio.sleep(0)
    gate.leave(first)  # resolves `handed`'s future ...
    handed.cancel()  # ... but it is cancelled before resuming
    with pytest.raises(asyncio.CancelledError):
        await handed
    ticket = await asyncio.wait_for(nxt, 1)
    gate.leave(ticket)
    assert gate.queued("e") == 0
