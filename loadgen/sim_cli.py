"""``kvkeeper sim``: run the vLLM-like engine simulator (see ``loadgen/sim``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from loadgen.sim.belady import EVICT_RULES
from loadgen.sim.engine import SCHEDULING_POLICIES
from loadgen.sim.profiles import PROFILES
from loadgen.sim.server import SimConfig, serve_forever

_D = SimConfig()


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default, unless its help already names it in words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "sim",
        help="run the engine simulator (vLLM V1 prefix cache, KV events, LMCache-like CPU tier)",
        description=(
            "An OpenAI/Anthropic-compatible server that models vLLM V1's prefix cache exactly "
            "(chained sha256_cbor block hashes, LRU free queue, preemption), publishes KV events "
            "over ZMQ in vLLM's wire format and serves vLLM's /metrics, /tokenize and "
            "/kv_event_sources. Ports of 0 bind ephemeral ports; once listening it prints "
            "'KVKEEPER_SIM_READY {json}' with the real endpoints."
        ),
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (HTTP and ZMQ)")
    p.add_argument("--port", type=int, default=8000, help="OpenAI-compatible HTTP port")
    p.add_argument("--model", default=_D.model, help="served model name")
    p.add_argument("--num-blocks", type=int, default=_D.num_blocks,
                   help="KV pool size in blocks, like --num-gpu-blocks-override (block 0 is "
                        "vLLM's null block, so one fewer is usable)")  # fmt: skip
    p.add_argument("--block-size", type=int, default=_D.block_size, help="tokens per block")
    p.add_argument("--hash-seed", default=_D.hash_seed, help="PYTHONHASHSEED the hashes use")
    p.add_argument("--profile", default=_D.profile, choices=sorted(PROFILES), help="timing model")
    p.add_argument("--speed", type=float, default=_D.speed, help="time speed-up factor")
    p.add_argument("--max-lag-s", type=float, default=_D.max_lag_s, metavar="SECONDS",
                   help="how far (wall seconds) the step loop may fall behind its modelled "
                        "clock and still catch up, so the simulator's own processing time "
                        "does not slow the modelled engine (0: it adds to every step)")  # fmt: skip
    p.add_argument("--events-port", type=int, default=5557, help="ZMQ PUB port for KV events")
    p.add_argument("--replay-port", type=int, default=5558, help="ZMQ ROUTER port for replay")
    p.add_argument("--no-replay", action="store_true", help="serve no replay endpoint")
    p.add_argument("--topic", default=_D.topic, help="ZMQ topic of KV event messages")
    p.add_argument("--cpu-blocks", type=int, default=_D.cpu_blocks,
                   help="CPU-tier size in blocks (0: no CPU tier)")  # fmt: skip
    p.add_argument("--cpu-l2-blocks", type=int, default=_D.cpu_l2_blocks,
                   help="the CPU tier's L2 in blocks, as LMCache MP's: L1 stays LRU, pins "
                        "protect L2 (0: one level that pins protect)")  # fmt: skip
    p.add_argument("--cpu-l2-load-factor", type=float, default=_D.cpu_l2_load_factor,
                   help="an L2 load costs this many L1 loads")  # fmt: skip
    p.add_argument("--lmcache-port", type=int, default=9300,
                   help="port of the LMCache-shaped control API (coordinator + MP server "
                        "routes), with --cpu-blocks")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, default=_D.max_num_batched_tokens,
                   help="token budget per step (chunked prefill)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=_D.max_num_seqs, help="batch size cap")
    p.add_argument("--long-prefill-token-threshold", type=int,
                   default=_D.long_prefill_token_threshold,
                   help="cap on one request's prefill chunk per step, so a long prompt shares "
                        "steps with others (0: off, vLLM's default)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=_D.max_model_len, help="context cap")
    p.add_argument("--reply-tokens", type=int, default=_D.reply_tokens,
                   help="length of the canned answer before EOS")  # fmt: skip
    p.add_argument("--scheduling-policy", default=_D.scheduling_policy,
                   choices=SCHEDULING_POLICIES,
                   help="waiting-queue order: arrival, or (priority, arrival) with requests' "
                        "`priority` field or X-Vllm-Priority header, as vLLM's flag")  # fmt: skip
    p.add_argument("--evict-oracle", default=_D.evict_oracle, metavar="FILE",
                   help="evict by Belady's rule (farthest next use first) from this oracle of "
                        "future block uses, as `bench compare`'s engine-belady target writes it "
                        "(default: vLLM's LRU)")  # fmt: skip
    p.add_argument("--evict-rule", default=_D.evict_rule, choices=EVICT_RULES,
                   help="with --evict-oracle: belady, or dead-first (blocks never used again "
                        "first, then vLLM's LRU: what an exact evict-on-finish hint gives)")  # fmt: skip
    p.add_argument("--log-level", default="WARNING", help="Python logging level (stderr)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        hash_seed=args.hash_seed,
        profile=args.profile,
        speed=args.speed,
        max_lag_s=args.max_lag_s,
        events_port=args.events_port,
        replay_port=None if args.no_replay else args.replay_port,
        topic=args.topic,
        cpu_blocks=args.cpu_blocks,
        cpu_l2_blocks=args.cpu_l2_blocks,
        cpu_l2_load_factor=args.cpu_l2_load_factor,
        lmcache_port=args.lmcache_port,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=args.max_model_len,
        reply_tokens=args.reply_tokens,
        scheduling_policy=args.scheduling_policy,
        evict_oracle=args.evict_oracle,
        evict_rule=args.evict_rule,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper())
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_forever(config_from_args(args)))
    return 0
