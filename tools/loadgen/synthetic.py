"""Seeded synthetic multi-turn chat workload shaped like the Mooncake conversation trace.

Shape (all block ids are prefix-chained, as in the Mooncake traces):

* every prompt starts with a shared system prompt of ``system_prompt_blocks``
  full blocks (ids ``0 .. system_prompt_blocks-1``);
* a conversation's first turn appends a fresh user message; each later turn
  keeps all *full* blocks of the previous turn's prompt and continues with new
  ids (the previous partial last block, the previous answer and the new user
  message are re-hashed into new blocks), so turn *k+1* extends turn *k*'s chain;
* most conversations are single-turn (``single_turn_fraction``);
* conversations start as a Poisson process (``rate_per_s``), later turns follow
  after a log-normal think time (heavy-tailed, mean ``mean_think_s``) plus a
  decode time of 20 ms per output token; the trace is the first ``n_requests``
  requests in time order.

Token counts are log-normal. The result is a pure function of the arguments.
With the defaults, 12,000 requests span about an hour with about 1.4 requests
per conversation, 23 blocks per request and an unbounded prefix hit rate near
35 %, close to the Mooncake conversation trace (12,031 requests, 24 blocks,
36.6 %).
"""

from __future__ import annotations

import heapq
import logging
import math
import random

from .traces import Request

logger = logging.getLogger(__name__)

__all__ = ["synthetic_trace"]


def _lognormal_int(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    """Log-normal integer with the given mean (before clipping to ``[lo, hi]``)."""
    mu = math.log(mean) - sigma * sigma / 2.0
    return max(lo, min(hi, int(rng.lognormvariate(mu, sigma))))


def synthetic_trace(
    n_requests: int,
    seed: int,
    *,
    block_tokens: int = 512,
    system_prompt_blocks: int = 2,
    single_turn_fraction: float = 0.8,
    mean_extra_turns: float = 2.0,
    max_turns: int = 20,
    rate_per_s: float = 2.4,
    mean_think_s: float = 400.0,
    mean_first_tokens: float = 10000.0,
    mean_followup_tokens: float = 800.0,
    mean_output_tokens: float = 340.0,
    max_input_tokens: int = 128 * 1024,
) -> list[Request]:
    """Build ``n_requests`` requests (timestamps in integral ms, sorted, first at 0).

    ``rate_per_s``: arrival rate of new conversations (req/s grows with the turns).
    ``mean_extra_turns``: mean number of turns after the first in a multi-turn
    conversation (geometric, capped so a conversation has at most ``max_turns``).
    ``mean_*_tokens``: log-normal means of the first user message (after the
    system prompt), of each later user message, and of the answers.
    Each request's ``session`` is ``"c<conversation index>"``.
    """
    if n_requests < 0:
        raise ValueError(f"n_requests must be >= 0, got {n_requests}")
    if block_tokens <= 0 or system_prompt_blocks < 0 or rate_per_s <= 0:
        raise ValueError("block_tokens and rate_per_s must be > 0, system_prompt_blocks >= 0")
    if not 0.0 <= single_turn_fraction <= 1.0:
        raise ValueError("single_turn_fraction must be in [0, 1]")
    rng = random.Random(seed)
    sys_tokens = system_prompt_blocks * block_tokens
    next_id = system_prompt_blocks
    p_more = mean_extra_turns / (1.0 + mean_extra_turns) if mean_extra_turns > 0 else 0.0

    # (timestamp_ms, generation order, request); generation order breaks ties.
    pending: list[tuple[float, int, Request]] = []
    out: list[tuple[float, int, Request]] = []
    order = 0
    t_start_ms = 0.0
    conv = 0
    while len(out) < n_requests:
        # Requests at or before this conversation's start can no longer be
        # preceded by a request of a later conversation: they are final.
        while pending and pending[0][0] <= t_start_ms:
            out.append(heapq.heappop(pending))
        if len(out) >= n_requests:
            break
        turns = 1
        if rng.random() >= single_turn_fraction:
            turns = 2
            while turns < max_turns and rng.random() < p_more:
                turns += 1
        session = f"c{conv}"
        conv += 1
        t_ms = t_start_ms
        prev_ids: list[int] = list(range(system_prompt_blocks))
        prev_input = sys_tokens
        prev_output = 0
        for turn in range(turns):
            if turn == 0:
                user = _lognormal_int(rng, mean_first_tokens, 1.0, 16, max_input_tokens)
                keep = system_prompt_blocks
                input_len = sys_tokens + user
            else:
                user = _lognormal_int(rng, mean_followup_tokens, 1.0, 4, max_input_tokens)
                keep = prev_input // block_tokens
                input_len = prev_input + prev_output + user
            if input_len > max_input_tokens:
                break  # the conversation ran out of context
            n_blocks = -(-input_len // block_tokens)
            ids = prev_ids[:keep] + list(range(next_id, next_id + n_blocks - keep))
            next_id += n_blocks - keep
            output_len = _lognormal_int(rng, mean_output_tokens, 0.9, 1, 4096)
            req = Request(float(round(t_ms)), input_len, output_len, ids, session)
            heapq.heappush(pending, (req.timestamp_ms, order, req))
            order += 1
            prev_ids, prev_input, prev_output = ids, input_len, output_len
            # log-normal with sigma 1.2 and mean mean_think_s (mu = ln(mean) - sigma^2 / 2)
            think_s = rng.lognormvariate(math.log(mean_think_s) - 0.72, 1.2)
            t_ms += think_s * 1000.0 + output_len * 20.0
        t_start_ms += rng.expovariate(rate_per_s) * 1000.0
    requests = [r for _, _, r in out[:n_requests]]
    logger.debug("synthetic trace: %d requests from %d conversations (seed %d)",
                 len(requests), conv, seed)
    return requests
