"""What one tenant may learn about another: nothing through the prefix cache, nothing in the logs.

The prefix cache shares KV blocks between requests with the same leading tokens, and a response's
`usage.prompt_tokens_details.cached_tokens` (and its latency) tells a client whether someone sent
that prefix before. A request's *cache salt* keeps its blocks apart: sequences match only blocks
cached under the same salt. The salt mixes the request's `cache_salt` field (vLLM's name) and, with
`--prefix-cache-isolation api-key`, the caller's API key; it is a digest, so neither travels to
the engine or into a log.
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request

PREFIX_CACHE_ISOLATION = ("none", "api-key")


def bearer_token(request: Request | None) -> str | None:
    """The caller's API key (`Authorization: Bearer KEY`), or None."""
    if request is None:
        return None
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def cache_salt(isolation: str, request_salt: str | None, api_key: str | None) -> str | None:
    """The salt a request's prefix-cache blocks are keyed under; None: the shared cache."""
    parts = []
    if isolation == "api-key":
        parts.append(f"key:{api_key or ''}")
    if request_salt:
        parts.append(f"salt:{request_salt}")
    if not parts:
        return None
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def shown_prompt(prompt: str | list[int], max_log_len: int | None) -> str | list[int]:
    """A prompt as the request log shows it: at most `max_log_len` characters (or token ids)."""
    return prompt if max_log_len is None else prompt[:max_log_len]
