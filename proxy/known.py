"""Sessions Redis accepted a moment ago: their repeats skip the upsert's round trip.

For a session that exists, asked again with the same parent, agent, TTL and retention, the
upsert can only answer ``accepted`` (its rejections are about creating sessions and linking
them). So while Redis has accepted a session within ``KNOWN_FOR_S`` and no Redis call has
failed since, a repeat is answered from memory and its upsert is written behind: merged per
session (the latest request's time, how many requests it stands for) and sent just before the
next batch of finished requests (``proxy/completions.py``), so Redis sees the same upserts and
completions in the same order as before, within the writer's interval. Those upserts answer
briefly (created or not, or the rejection), so nothing is decoded for a session that simply
existed: a session is known for ``KNOWN_FOR_S`` after its last synchronous registration, then
its next request registers again and reads what Redis has. A rejection (the session was freed
and its tenant is full), or a session created again, forgets the session; a Redis failure
forgets them all, and the next requests register synchronously and answer what Redis says.

What memory misses is what other processes wrote to the session since its last registration
(at most ``KNOWN_FOR_S`` ago): the engine another replica served it on (placement reads it
only for prompts too short to place by their prefix), a touch another process recorded (this
process's own are applied). A session freed meanwhile is created again by the upsert written
behind, as its registration would have.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.hint_model import Hint
from proxy.store import SessionStore, StoreDown, Upserted
from proxy.store_writes import Template

log = logging.getLogger("kvkeeper.known")

KNOWN_FOR_S = 30.0  # how long after Redis last accepted a session its repeats skip the upsert
MAX_KNOWN = 100_000  # sessions remembered per process (the oldest go first)
MAX_PENDING = 50_000  # written-behind upserts kept while Redis is down

Key = tuple[str, str]  # (tenant, session id)
Shape = tuple[str | None, str | None, float | None, str]


def _shape(hint: Hint) -> Shape:
    """What an upsert writes besides the time: a repeat must ask for the same."""
    return hint.parent_session_id, hint.agent_name, hint.ttl_s, hint.retention


@dataclass(slots=True)
class _Entry:
    shape: Shape
    upserted: Upserted  # the session as a repeat's upsert would find it
    confirmed: float  # monotonic time Redis last accepted it
    template: Template | None = None  # its upsert, packed once (store.upsert_template)


@dataclass(slots=True)
class _Behind:
    hint: Hint
    now: float
    requests: int
    template: Template | None


class KnownSessions:
    """Per process: sessions known to Redis, and the upserts of their repeats not yet sent."""

    def __init__(
        self,
        *,
        known_for_s: float = KNOWN_FOR_S,
        max_known: int = MAX_KNOWN,
        max_pending: int = MAX_PENDING,
        on_created: Callable[[], None] | None = None,
    ) -> None:
        self.known_for_s = known_for_s
        self.max_known = max_known
        self.max_pending = max_pending
        self._on_created = on_created
        self._known: dict[Key, _Entry] = {}
        self._behind: dict[Key, _Behind] = {}
        self.repeats = 0  # requests answered from memory (for tests and the benchmark)

    def __len__(self) -> int:
        return len(self._known)

    @property
    def pending(self) -> bool:
        return bool(self._behind)

    def repeat(self, tenant: str, hint: Hint, now: float) -> Upserted | None:
        """The session as its upsert would find it, when this request may skip the upsert
        (its upsert is then queued to be written behind); else None."""
        key = (tenant, hint.session_id)
        entry = self._known.get(key)
        queued = self._behind.get(key)
        if (
            entry is None
            or entry.shape
            != (hint.parent_session_id, hint.agent_name, hint.ttl_s, hint.retention)  # _shape
            or time.monotonic() - entry.confirmed > self.known_for_s
        ):
            if queued is not None:  # it registers first: what is queued then asks the same
                queued.hint, queued.now, queued.template = hint, now, None
            return None
        if queued is None:
            self._behind[key] = _Behind(hint, now, 1, entry.template)
        else:
            queued.hint, queued.now, queued.requests = hint, now, queued.requests + 1
        self.repeats += 1
        return entry.upserted

    def accepted(self, tenant: str, hint: Hint, up: Upserted) -> None:
        """Redis accepted the session's upsert just now (``up``: as it found the session)."""
        key = (tenant, hint.session_id)
        entry = self._known.pop(key, None)
        if entry is None and len(self._known) >= self.max_known:
            del self._known[next(iter(self._known))]
        self._known[key] = _Entry(_shape(hint), _merged(entry, up), time.monotonic())

    def completed(self, tenant: str, sid: str, engine: str, now: float, prompt: int) -> None:
        """A request of the session finished on ``engine`` (what its next upsert would read)."""
        entry = self._known.get((tenant, sid))
        if entry is not None and now >= entry.upserted.last_active:
            entry.upserted = Upserted(False, engine, entry.upserted.parent_engine, now, prompt)

    def touched(self, tenant: str, sid: str, now: float) -> None:
        """This process recorded a keep-alive touch of the session (its last activity)."""
        entry = self._known.get((tenant, sid))
        if entry is not None and now > entry.upserted.last_active:
            up = entry.upserted
            entry.upserted = Upserted(
                False, up.engine, up.parent_engine, now, up.last_prompt_tokens
            )

    def forget_all(self) -> None:
        """Redis failed: every session registers synchronously again (queued upserts stay)."""
        self._known.clear()

    def take(self) -> dict[Key, _Behind]:
        """The queued upserts, to be written now."""
        batch, self._behind = self._behind, {}
        return batch

    async def write(self, store: SessionStore, batch: dict[Key, _Behind]) -> None:
        """Send taken upserts in one pipeline; kept for the next write if Redis is down."""
        if not batch:
            return
        calls = []
        for (tenant, sid), b in batch.items():
            if b.template is None:
                b.template = store.upsert_template(tenant, b.hint)
                if (entry := self._known.get((tenant, sid))) is not None:
                    entry.template = b.template
            calls.append((tenant, b.hint, b.now, b.requests, b.template))
        try:
            results = await store.upsert_many(calls)
        except StoreDown:
            self.forget_all()
            self._requeue(batch)
            return
        known = self._known
        for key, result in zip(batch, results, strict=True):
            if result is False:  # accepted: what is known stands until it is confirmed again
                continue
            if result is True:  # freed meanwhile: its repeat created it again
                if self._on_created is not None:
                    self._on_created()
            else:
                log.debug("session %s rejected behind its request: %s", key, result.reason)
            known.pop(key, None)  # its next request registers and reads what Redis has

    def _requeue(self, batch: dict[Key, _Behind]) -> None:
        for key, later in self._behind.items():
            if key in batch:
                earlier = batch[key]
                later.requests += earlier.requests
                batch[key] = later
            else:
                batch[key] = later
        for key in list(batch)[: max(0, len(batch) - self.max_pending)]:
            del batch[key]
        self._behind = batch


def _merged(entry: _Entry | None, up: Upserted) -> Upserted:
    """Redis's answer, unless this process has finished a request of the session after what
    Redis had (its completion is written after the upsert)."""
    if entry is None or entry.upserted.last_active <= up.last_active:
        if not up.created:
            return up
        return Upserted(False, up.engine, up.parent_engine, up.last_active, up.last_prompt_tokens)
    mine = entry.upserted
    return Upserted(False, mine.engine, up.parent_engine, mine.last_active, mine.last_prompt_tokens)
