"""Prefill/decode disaggregation in the router (`inferd router --pd-disaggregation`).

Each generation request goes twice, to two pools of workers:

1. to a prefill worker (`inferd serve --kv-role prefill`), as the client sent it but with
   `max_tokens` 1, no stream and `kv_transfer_params: {"do_remote_decode": true}`: it computes the
   prompt and the first token, keeps the prompt's KV blocks pinned, and answers with a transfer
   handle in its response's `kv_transfer_params`;
2. then to a decode worker (`--kv-role decode`), as the client sent it plus that handle: it pulls
   the blocks its own prefix cache lacks, takes the first token from the handle, and streams the
   whole answer (SSE as usual, usage included) back through the router.

Sampling parameters and seeds pass through unchanged (the decode worker continues the seeded
generator past the first token). Requests PD does not carry — n > 1, best_of, logprobs, echo,
batched prompts — and requests whose prefill leg fails (no prefill worker, or one that cannot be
reached) go to a decode worker alone, which computes everything: slower, never wrong. A prefill
worker's own answer to bad input (4xx) is the client's answer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from fastapi.responses import Response

from inferd.router.keys import Key
from inferd.router.proxy import Forwarder
from inferd.server.errors import APIError

logger = logging.getLogger("inferd.router")


def carried(path: str, body: dict[str, Any]) -> bool:
    """Whether PD serves this request (else a decode worker serves it alone)."""
    if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1) or body.get("echo"):
        return False
    if "kv_transfer_params" in body:  # the client's own: not ours to rewrite
        return False
    if path.endswith("/chat/completions"):
        return not body.get("logprobs")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return False  # several prompts in one request
    return body.get("logprobs") is None


def prefill_body(path: str, body: dict[str, Any]) -> bytes:
    """The prefill leg's request: the client's, stopped after the first token, not streamed."""
    leg = {
        k: v
        for k, v in body.items()
        if k not in ("stream", "stream_options", "max_completion_tokens")
    }
    leg["max_tokens"] = 1
    if isinstance(body.get("min_tokens"), int):
        leg["min_tokens"] = min(body["min_tokens"], 1)  # EOS held back from the first token alike
    leg["stream"] = False
    leg["kv_transfer_params"] = {"do_remote_decode": True}
    return orjson.dumps(leg)


class PDForwarder:
    """Sends each request through a prefill worker, then streams it from a decode worker."""

    def __init__(self, prefill: Forwarder, decode: Forwarder) -> None:
        self.prefill = prefill
        self.decode = decode
        self.num_fallbacks = 0  # requests served by a decode worker alone

    async def forward(self, path: str, body: bytes, parsed: dict[str, Any], headers: dict[str, str],
                      key: Key, started: float) -> Response:  # fmt: skip
        if not carried(path, parsed):
            return await self.decode.forward(path, body, headers, key, started)
        handle = None
        try:
            answer = await self.prefill.forward(
                path, prefill_body(path, parsed), headers, key, started
            )
        except APIError as e:  # no healthy prefill worker: the decode side computes it all
            logger.warning("prefill leg skipped: %s", e)
        else:
            if answer.status_code != 200:
                if 400 <= answer.status_code < 500 and answer.status_code not in (408, 429):
                    return (
                        answer  # the client's request is at fault: the decode side would say so too
                    )
                logger.warning("prefill leg answered %d; decoding alone", answer.status_code)
            else:
                try:
                    handle = orjson.loads(answer.body).get("kv_transfer_params")
                except (orjson.JSONDecodeError, AttributeError):
                    handle = None
        if not isinstance(handle, dict):
            self.num_fallbacks += 1
            return await self.decode.forward(path, body, headers, key, time.perf_counter())
        leg = dict(parsed)
        leg["kv_transfer_params"] = {**handle, "do_remote_prefill": True}
        return await self.decode.forward(path, orjson.dumps(leg), headers, key, time.perf_counter())
