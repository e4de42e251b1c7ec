"""The block-hash self-check: do kvkeeper's block hashes match the engine's KV events?

Residency tracking compares the block hashes kvkeeper computes for a session's tokens with the
hashes the engine publishes in its KV events. A different hash seed (an engine started without
the ``PYTHONHASHSEED`` that kvkeeper's ``cache.hash_seed`` names), hash function or block
size makes every comparison miss, silently: kvkeeper would see nothing resident.

So kvkeeper checks the engine's own events, without sending anything: until decided, the
subscriber decodes the token ids of stored blocks, and for each ``BlockStored`` that starts a
prompt (no parent block) kvkeeper hashes the same tokens and compares. The process holding the
engine's KV-event subscription (its lease holder) checks; the result reaches the others through
its relay (``proxy/residency_share.py``).

- a match: ``ok`` (token ids are no longer decoded);
- ``MISMATCHES`` root events in a row without a match: ``mismatch``: an error is logged,
  ``kvkeeper_hash_check`` goes to 0, ``/admin/engines`` shows it, and the engine falls back to
  feedback mode (its event subscription is closed; retention works from ``cached_tokens``, as
  for an engine without events). Several are needed because a request with a ``cache_salt``
  hashes its first block with the salt, which the event does not carry.
- no such event yet (an idle engine): ``pending``.

``kvkeeper_hash_check{engine}``: 1 ok, 0 mismatch, -1 pending or no KV events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from adapters.base import EngineAdapter, EventSink, EventSubscription
from adapters.kv_events import GPU, BlockStored, EventBatch
from proxy.admin_models import HashCheckView

if TYPE_CHECKING:
    from proxy.engine_state import EngineState
    from proxy.metrics import Metrics
    from proxy.retention import Retention

log = logging.getLogger("kvkeeper.hashcheck")

MISMATCHES = 3  # root events without a match before the hashes are declared different
SUBSCRIBED_POLL_S = 0.5  # how often a process without the subscription looks again


@dataclass(slots=True)
class HashCheck:
    """One engine's result, as /admin/engines shows it."""

    status: str = "pending"  # pending | ok | mismatch | no_events
    detail: str | None = None
    checked_at: float | None = None
    matched: int = 0
    mismatched: int = 0

    def view(self) -> HashCheckView:
        return HashCheckView(status=self.status, detail=self.detail, checked_at=self.checked_at)


HASH_CHECKS = web.AppKey("hash_checks", dict[str, HashCheck])


class CheckingSink:
    """An event sink in front of the engine's own: compares root ``BlockStored`` hashes with
    kvkeeper's for the same token ids, then passes the batch on unchanged."""

    def __init__(
        self,
        inner: EventSink,
        adapter: EngineAdapter,
        result: HashCheck,
        decided: asyncio.Event,
        token_ids_before: bool = False,
    ) -> None:
        self.inner = inner
        self.adapter = adapter
        self.result = result
        self.decided = decided
        self.token_ids_before = token_ids_before  # the subscription's setting, given back

    def apply(self, batch: EventBatch) -> None:
        self.inner.apply(batch)
        if self.decided.is_set():
            return
        for event in batch.events:
            if (
                isinstance(event, BlockStored)
                and event.parent_block_hash is None
                and event.medium == GPU
                and event.lora_name is None
                and event.token_ids
            ):
                self._compare(event)
                if self.decided.is_set():
                    return

    def _compare(self, event: BlockStored) -> None:
        size = self.adapter.cache.block_size
        n = min(len(event.block_hashes), len(event.token_ids) // size)
        ours = self.adapter.hash_blocks(event.token_ids[: n * size]) if n else []
        r = self.result
        r.checked_at = time.time()
        if n and event.block_size == size and ours == list(event.block_hashes[:n]):
            r.matched += 1
            r.status, r.detail = "ok", f"kvkeeper's hashes of {n} stored blocks match the engine's"
            self.decided.set()
            return
        r.mismatched += 1
        r.detail = (
            f"{r.mismatched} stored prompts hashed differently: the engine's block size "
            f"{event.block_size}, kvkeeper's {size} with hash seed {self.adapter.cache.hash_seed!r}; "
            "start the engine with PYTHONHASHSEED equal to cache.hash_seed and "
            "--prefix-caching-hash-algo sha256_cbor"
        )
        if r.mismatched >= MISMATCHES:
            r.status = "mismatch"
            self.decided.set()

    def clear(self) -> None:
        self.inner.clear()


async def fall_back(es: EngineState) -> None:
    """Stop trusting the engine's events: feedback mode from now on."""
    await es.signals.fall_back()


async def check_engine(
    name: str, es: EngineState, result: HashCheck, metrics: Metrics, stopping: asyncio.Event
) -> None:
    """Watch one engine's events until the check is decided (or ``stopping`` is set). The
    process holding the engine's KV-event subscription checks (from the first batch of each
    subscription it starts); the others learn a mismatch from its relay (events off)."""
    if not es.signals.has_events:
        result.status, result.detail = "no_events", "no KV events: nothing to check"
        return
    decided = asyncio.Event()

    def wrap(sub: EventSubscription) -> None:
        if not isinstance(sub.sink, CheckingSink):
            sub.sink = CheckingSink(sub.sink, es.adapter, result, decided, sub.token_ids)
            sub.token_ids = True

    es.signals.on_subscribed = wrap
    if es.signals.subscription is not None:
        wrap(es.signals.subscription)
    result.detail = "checked by the process subscribed to the engine's KV events"
    try:
        while not (decided.is_set() or stopping.is_set()):
            if not es.signals.has_events:  # the subscribing process found a mismatch
                result.status = "mismatch"
                result.detail = "the process subscribed to the engine's KV events found it"
                break
            if es.signals.hashes_match and not decided.is_set():  # ... or that they match
                result.status, result.checked_at = "ok", time.time()
                result.detail = "checked by the process subscribed to the engine's KV events"
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(decided.wait(), SUBSCRIBED_POLL_S)
    finally:
        es.signals.on_subscribed = None
        sub = es.signals.subscription
        checking = sub.sink if sub is not None else None
        if sub is not None and isinstance(checking, CheckingSink):
            sub.sink, sub.token_ids = checking.inner, checking.token_ids_before
    if result.status == "ok":
        if not es.signals.hashes_match:
            es.signals.matched()
        metrics.hash_check.labels(name).set(1)
        log.info("hash check on %s: ok (%s)", name, result.detail)
    elif result.status == "mismatch":
        metrics.hash_check.labels(name).set(0)
        log.error(
            "hash check on %s FAILED: %s. Residency tracking is off for this engine: retention "
            "falls back to feedback mode",
            name,
            result.detail,
        )
        await fall_back(es)


async def check_engines(
    retention: Retention, results: dict[str, HashCheck], metrics: Metrics, stopping: asyncio.Event
) -> None:
    """Check every engine in events mode, side by side."""
    for name in retention.engines:
        metrics.hash_check.labels(name).set(-1)
        results.setdefault(name, HashCheck())
    await asyncio.gather(
        *(
            check_engine(name, es, results[name], metrics, stopping)
            for name, es in retention.engines.items()
        )
    )
