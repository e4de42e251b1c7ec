"""The simulated engine core: vLLM V1's scheduler loop over the block pool, in wall-clock time.

Each step (``vllm/v1/core/sched/scheduler.py``):

1. running requests first, in order, each taking up to the remaining token budget
   (``max_num_batched_tokens``); when the pool cannot give one of them a block, the LAST running
   request is preempted (blocks freed, progress reset, back to the front of the waiting queue)
   until it fits or the request preempts itself; under ``--scheduling-policy priority`` the
   victim is the running request with the largest (priority, arrival) instead;
2. if nobody was preempted, waiting requests join in queue order (arrival, or (priority,
   arrival) under the priority policy) while budget and ``max_num_seqs`` allow, the first that
   does not fit stopping the rest: a prefix-cache lookup (plus the CPU tier, when present)
   decides how many tokens are already computed, and a long prompt gets only the budget left
   (chunked prefill);
3. the step "runs" for the time the profile gives, then every request whose scheduled tokens
   reach the end of its sequence samples one token; finished requests free their blocks.

The KV events produced during a step are flushed once at its end, as vLLM publishes one batch
per engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from loadgen.sim.belady import BeladyOracle, EvictRule
from loadgen.sim.block_pool import BlockPool, KVEvent
from loadgen.sim.cpu_tier import CpuTier
from loadgen.sim.kv_manager import BlockHashCache, KVCacheManager, Sequence
from loadgen.sim.profiles import Profile
from loadgen.sim.stats import EngineStats

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Geometry and scheduling limits (vLLM flag names in comments)."""

    num_blocks: int = 2048  # --num-gpu-blocks-override
    block_size: int = 32  # --block-size
    hash_seed: str = "0"  # PYTHONHASHSEED
    max_num_batched_tokens: int = 2048  # --max-num-batched-tokens
    max_num_seqs: int = 256  # --max-num-seqs
    long_prefill_token_threshold: int = 0  # --long-prefill-token-threshold (0: off)
    max_model_len: int = 131_072  # --max-model-len
    cpu_blocks: int = 0  # CPU tier size in blocks (0: no tier)
    cpu_l2_blocks: int = 0  # the tier's L2 in blocks (0: one level that pins protect)
    cpu_l2_load_factor: float = 4.0  # an L2 load costs this many L1 loads (disk vs memory)
    scheduling_policy: SchedulingPolicy = "fcfs"  # --scheduling-policy
    speed: float = 1.0  # >1 runs faster than the profile
    # how far (wall seconds) the step loop may fall behind its modelled clock and still catch
    # up; 0: every step's own processing time adds to its modelled time
    max_lag_s: float = 1.0
    reply_tokens: int = 16  # length of the canned answer before EOS
    evict_oracle: str = ""  # a Belady oracle file: evict by future use, not LRU (belady.py)
    evict_rule: EvictRule = "belady"  # with an oracle: Belady, or dead blocks first then LRU


@dataclass(frozen=True, slots=True)
class Finished:
    """End-of-stream marker put on a request's output queue."""

    reason: str  # "stop" | "length" | "abort"


@dataclass(eq=False)
class SimRequest:
    """One request in flight; the server reads tokens from ``outputs``."""

    seq: Sequence
    prompt_len: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    reply: list[int]
    arrival: float
    priority: int = 0  # lower is served first under the priority policy; ignored under FCFS
    speed: float = 1.0  # the engine's ``speed`` (its wall times are its profile's / speed)
    outputs: asyncio.Queue[int | Finished] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1  # set at first scheduling (usage.cached_tokens)
    num_external_tokens: int = 0
    num_preemptions: int = 0
    scheduled_at: float | None = None  # its first scheduling (vLLM's scheduled_ts)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    stored_to_cpu: bool = False
    # CPU-tier chunk keys of the first ``cpu_keys_for`` tokens: hashed once, not at every step
    # the request waits at the head of the queue (hashing a long prompt takes real time, which
    # the simulator's clock would count as engine time)
    cpu_keys: list[str] = field(default_factory=list)
    cpu_keys_for: int = -1


@dataclass(slots=True)
class _StepPlan:
    scheduled: list[tuple[SimRequest, int]]
    prefill_tokens: int = 0
    cached_tokens: int = 0
    loaded_tokens: int = 0
    l2_loaded_tokens: int = 0  # of loaded_tokens
    decodes: int = 0
    preempted: bool = False
    arrived: float = float("-inf")  # the latest arrival among requests it admits


class WaitingQueue:
    """vLLM's waiting queue: first come, first served (a preempted request goes back to the
    front), or, under the priority policy, a heap on (priority, arrival) where a preempted
    request simply rejoins (``vllm/v1/core/sched/request_queue.py``)."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._fifo: deque[SimRequest] = deque()
        self._heap: list[tuple[int, float, int, SimRequest]] = []
        self._order = itertools.count()

    def add(self, req: SimRequest) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (req.priority, req.arrival, next(self._order), req))
        else:
            self._fifo.append(req)

    def prepend(self, req: SimRequest) -> None:
        if self.policy == "priority":
            self.add(req)
        else:
            self._fifo.appendleft(req)

    def peek(self) -> SimRequest:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> SimRequest:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, req: SimRequest) -> bool:
        if self.policy == "fcfs":
            if req in self._fifo:
                self._fifo.remove(req)
                return True
            return False
        kept = [e for e in self._heap if e[3] is not req]
        if len(kept) == len(self._heap):
            return False
        self._heap = kept
        heapq.heapify(self._heap)
        return True

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)


class EngineRejected(ValueError):
    """The request can never run (too long for the model or the KV pool)."""


class SimEngine:
    """Owns the pool, the queues and the step loop task."""

    def __init__(
        self,
        config: EngineConfig,
        profile: Profile,
        on_events: Callable[[list[KVEvent]], None] | None = None,
    ) -> None:
        self.config = config
        self.profile = profile
        self.events: list[KVEvent] = []
        oracle = (
            BeladyOracle.load(config.evict_oracle, config.block_size, config.hash_seed)
            if config.evict_oracle
            else None
        )
        self.pool = BlockPool(
            config.num_blocks, config.block_size, self.events, oracle, config.evict_rule
        )
        self.kv = KVCacheManager(self.pool, BlockHashCache(config.block_size, config.hash_seed))
        chunks = config.cpu_blocks * config.block_size // 256
        l2_chunks = config.cpu_l2_blocks * config.block_size // 256
        self.cpu: CpuTier | None = (
            CpuTier(
                chunks,
                config.block_size,
                config.hash_seed,
                self.events,
                l2_capacity_chunks=l2_chunks,
            )
            if chunks
            else None
        )
        self.stats = EngineStats()
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[SimRequest] = []
        self._on_events = on_events
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._task: asyncio.Task[None] | None = None
        usable_tokens = (config.num_blocks - 1) * config.block_size
        self.max_model_len = min(config.max_model_len, usable_tokens)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int | None,
        cache_salt: str | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        reply: list[int],
        priority: int = 0,
    ) -> SimRequest:
        """Queue a request; raises :class:`EngineRejected` when it can never fit."""
        n = len(prompt_ids)
        if n == 0:
            raise EngineRejected("prompt is empty")
        if n >= self.max_model_len:
            raise EngineRejected(
                f"prompt has {n} tokens; this engine's maximum context is {self.max_model_len}"
            )
        limit = self.max_model_len - n
        seq = Sequence(f"req-{next(self._ids)}", list(prompt_ids), cache_salt)
        req = SimRequest(
            seq=seq,
            prompt_len=n,
            max_tokens=min(max_tokens, limit) if max_tokens is not None else limit,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            reply=reply or [0],
            arrival=asyncio.get_running_loop().time(),
            priority=priority,
            speed=self.config.speed,
        )
        self.kv.hasher.update(seq)  # hash once at arrival, like vLLM's request.block_hashes
        self.waiting.add(req)
        self._wake.set()
        return req

    def abort(self, req: SimRequest) -> None:
        """Drop a request (client went away); frees its blocks at once."""
        if req.finish_reason is not None:
            return
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req.seq)
        self._finish(req, "abort")
        self.flush_events()

    def reset_prefix_cache(self, reset_running: bool = False) -> bool:
        """``POST /reset_prefix_cache``: refused while blocks are held unless asked to preempt."""
        if reset_running:
            while self.running:
                self._preempt(self.running.pop())
        # Like vLLM, AllBlocksCleared waits in the event queue for the next step's batch.
        return self.pool.reset_prefix_cache()

    def flush_events(self) -> None:
        if not self.events:
            return
        batch = list(self.events)
        self.events.clear()
        if self._on_events is not None:
            self._on_events(batch)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        """Steps on a modelled clock: each step ends ``step_seconds / speed`` after the last one
        did, so the simulator's own processing time (scheduling, hashing, streaming the tokens)
        is absorbed into the modelled step instead of added to it, as long as it is shorter on
        the whole; what it cannot absorb beyond ``max_lag_s`` is dropped and counted
        (``stats.lag_s``), since a real engine's steps do not wait on a Python simulator."""
        loop = asyncio.get_running_loop()
        due = loop.time()  # when the last step ended on the modelled clock
        while True:
            if not self.busy:
                await self._idle()
                due = loop.time()
            plan = self._schedule()
            if not plan.scheduled and plan.preempted:  # the head preempted itself: step again
                self.flush_events()
                await asyncio.sleep(0)
                continue
            if not plan.scheduled:
                self.flush_events()
                await self._idle()
                due = loop.time()
                continue
            step = self.profile.step_seconds(
                prefill_tokens=plan.prefill_tokens,
                cached_tokens=plan.cached_tokens,
                loaded_tokens=plan.loaded_tokens,
                decodes=plan.decodes,
                l2_loaded_tokens=plan.l2_loaded_tokens,
                l2_load_factor=self.config.cpu_l2_load_factor,
            )
            seconds = step / self.config.speed
            floor = loop.time() - self.config.max_lag_s
            if floor > due:
                self.stats.lag_s += floor - due
                due = floor
            # catching up never runs a request's first step before it arrived
            due = max(due, plan.arrived) + seconds
            self.stats.modelled_s += seconds
            await asyncio.sleep(max(0.0, due - loop.time()))
            self._update(plan, loop.time())
            self.flush_events()

    async def _idle(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    def _schedule(self) -> _StepPlan:
        plan = _StepPlan(scheduled=[])
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._cap(req.seq.num_tokens - req.seq.num_computed_tokens), budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req.seq, n):
                k = self._victim()
                victim = self.running.pop(k)
                if k < i:  # priority policy: a request before this one, maybe scheduled already
                    i -= 1
                    if any(r is victim for r, _ in plan.scheduled):
                        budget += self._unplan(plan, victim)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self._plan_add(plan, req, n)
                budget -= n
                i += 1
                continue
            break  # the request preempted itself: nothing after it can run either
        plan.preempted = preempted
        if not preempted:
            self._admit_waiting(plan, budget)
        for req, n in plan.scheduled:
            req.seq.num_computed_tokens += n
        return plan

    def _admit_waiting(self, plan: _StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            seq = req.seq
            hits = self.kv.get_computed_blocks(seq)
            local = len(hits) * self.config.block_size
            external, from_l2 = self._external_hit(req, local)
            n = min(self._cap(seq.num_tokens - local - external), budget)
            if not self.kv.allocate_slots(
                seq, n, local + external, hits, full_sequence_must_fit=True
            ):
                break
            self.waiting.pop()
            self.kv.record_lookup(seq, hits, preempted=req.num_preemptions > 0)
            # as vLLM's connector stats: once admitted, the tokens beyond the local hit
            if self.cpu is not None:
                self.stats.external_queries += seq.num_tokens - local
                self.stats.external_hits += external
            self.running.append(req)
            seq.num_computed_tokens = local + external
            if req.num_cached_tokens < 0:
                req.scheduled_at = asyncio.get_running_loop().time()
                req.num_cached_tokens = local + external
                req.num_external_tokens = external
            plan.cached_tokens += local
            plan.loaded_tokens += external
            plan.l2_loaded_tokens += from_l2
            plan.arrived = max(plan.arrived, req.arrival)
            self._plan_add(plan, req, n)
            budget -= n

    def _external_hit(self, req: SimRequest, local: int) -> tuple[int, int]:
        """Tokens beyond the local hit that the CPU tier can load (never the last token), and
        how many of them come from its L2."""
        if self.cpu is None:
            return 0, 0
        seq = req.seq
        sources = self.cpu.lookup_sources(
            seq.token_ids, seq.cache_salt, self._cpu_keys(req, seq.num_tokens)
        )
        ct = self.cpu.chunk_tokens
        end = min(len(sources) * ct, seq.num_tokens - 1)
        external = max(0, end - local)
        from_l2 = sum(
            max(0, min(end, (i + 1) * ct) - max(local, i * ct))
            for i, l2 in enumerate(sources)
            if l2
        )
        return external, from_l2

    def _cap(self, n: int) -> int:
        """vLLM's ``long_prefill_token_threshold``: bounds one request's chunk per step."""
        threshold = self.config.long_prefill_token_threshold
        return threshold if 0 < threshold < n else n

    @staticmethod
    def _is_decode(req: SimRequest, n: int) -> bool:
        seq = req.seq
        return n == 1 and bool(req.output_ids) and seq.num_computed_tokens == seq.num_tokens - 1

    def _plan_add(self, plan: _StepPlan, req: SimRequest, n: int) -> None:
        plan.scheduled.append((req, n))
        if self._is_decode(req, n):
            plan.decodes += 1
        else:
            plan.prefill_tokens += n

    def _unplan(self, plan: _StepPlan, req: SimRequest) -> int:
        """Take a running request scheduled earlier in this step back out; its tokens."""
        k = next(k for k, (r, _) in enumerate(plan.scheduled) if r is req)
        _, n = plan.scheduled.pop(k)
        if self._is_decode(req, n):
            plan.decodes -= 1
        else:
            plan.prefill_tokens -= n
        return n

    def _victim(self) -> int:
        """Where in ``running`` the request to preempt is: the last one, or under the priority
        policy the one with the largest (priority, arrival)."""
        if self.config.scheduling_policy == "priority":
            return max(range(len(self.running)), key=lambda k: self._rank(self.running[k]))
        return len(self.running) - 1

    @staticmethod
    def _rank(req: SimRequest) -> tuple[int, float]:
        return req.priority, req.arrival

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req.seq)
        req.seq.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.prepend(req)

    def _update(self, plan: _StepPlan, now: float) -> None:
        for req, _ in plan.scheduled:
            seq = req.seq
            if req.finish_reason is not None or seq.num_computed_tokens < seq.num_tokens:
                continue  # aborted mid-step, or a prefill chunk that did not reach the end
            self._store_to_cpu(req)
            token = req.reply[len(req.output_ids) % len(req.reply)]
            req.output_ids.append(token)
            seq.token_ids.append(token)
            if req.first_token_at is None:
                req.first_token_at = now
                self.stats.ttft.observe(now - req.arrival)
                self.stats.prefill.observe(now - (req.scheduled_at or req.arrival))
                self.stats.prompt_tokens += req.prompt_len
            else:
                self.stats.inter_token.observe(now - (req.last_token_at or now))
            req.last_token_at = now
            self.stats.generation_tokens += 1
            req.outputs.put_nowait(token)
            reason = self._stop_reason(req)
            if reason is not None:
                self.running.remove(req)
                self.kv.free(seq)
                self._finish(req, reason)

    def _stop_reason(self, req: SimRequest) -> str | None:
        produced = len(req.output_ids)
        if produced >= req.max_tokens:
            return "length"
        if not req.ignore_eos and produced >= max(self.config.reply_tokens, req.min_tokens):
            return "stop"
        return None

    def _store_to_cpu(self, req: SimRequest) -> None:
        if self.cpu is None or req.stored_to_cpu:
            return
        req.stored_to_cpu = True
        prompt = req.seq.token_ids[: req.prompt_len]
        keys = self._cpu_keys(req, req.prompt_len)
        self.cpu.store(prompt, req.seq.block_hashes, req.seq.cache_salt, keys)

    def _cpu_keys(self, req: SimRequest, n_tokens: int) -> list[str]:
        """The tier's chunk keys of the request's first ``n_tokens`` tokens, hashed once."""
        assert self.cpu is not None
        if req.cpu_keys_for != n_tokens:
            tokens = req.seq.token_ids[:n_tokens]
            req.cpu_keys = self.cpu.chunk_keys(tokens, req.seq.cache_salt)
            req.cpu_keys_for = n_tokens
        return req.cpu_keys

    def _finish(self, req: SimRequest, reason: str) -> None:
        req.finish_reason = reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        req.outputs.put_nowait(Finished(reason))
