"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): drafts from what this request and recent
other requests wrote, no model. Every sequence's prompt and output go into one shared index
(inferd.spec.suffix_cache) as they grow and stay there, bounded, after the request leaves; a
draft continues the longest earlier match of the sequence's last tokens, in its own context or in
any other request's under the same cache salt. Pays where traffic repeats itself: agents
re-issuing the same calls, the same questions asked again, boilerplate, and (like prompt lookup)
outputs that copy their input.

The draft follows the continuation most places agree on (weighted by how many requests wrote each
place), token by token: at each depth the most frequent next token among the places still in
agreement, the estimated probability of the whole draft the product of each choice's share. It
stops where that estimate drops below `min_token_prob`, where the places run out, or at
`max_spec_factor` drafts per matched token (SuffixDecoding's length rule: a long match is a
confident one, a 2-token match earns 2 drafts at most), and never beyond the policy's k.
"""

from __future__ import annotations

from collections.abc import Callable

from inferd.config import SpeculativeConfig
from inferd.scheduler.sequence import Sequence
from inferd.spec.proposer import Proposer
from inferd.spec.suffix_cache import Candidate, Document, SuffixCache


def draft_from(found: list[Candidate], k: int, min_prob: float) -> list[int]:
    """Up to k tokens continuing the places in `found`, the likeliest by weight at each depth,
    while the draft's estimated probability stays >= `min_prob`."""
    if len(found) == 1:  # one place: its continuation, as far as it goes
        doc, c = found[0]
        return doc.tokens[c : c + k]
    draft: list[int] = []
    prob = 1.0
    for j in range(k):
        weights: dict[int, int] = {}  # next token -> weight, in order of the places' recency
        for doc, c in found:
            if c + j < len(doc.tokens):
                token = doc.tokens[c + j]
                weights[token] = weights.get(token, 0) + doc.weight
        if not weights:
            break
        token, weight = max(weights.items(), key=lambda tw: tw[1])  # ties: the most recent
        prob *= weight / sum(weights.values())
        if prob < min_prob:
            break
        draft.append(token)
        found = [(d, c) for d, c in found if c + j < len(d.tokens) and d.tokens[c + j] == token]
        if len(found) == 1:
            doc, c = found[0]
            return draft + doc.tokens[c + j + 1 : c + k]
    return draft


class SuffixProposer(Proposer):
    method = "suffix"
    shares_across_requests = True

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.cache = SuffixCache(spec.suffix_decoding_max_cached_tokens,
                                 spec.suffix_decoding_max_cached_requests,
                                 spec.suffix_decoding_max_tree_depth)  # fmt: skip
        self.max_spec_factor = spec.suffix_decoding_max_spec_factor
        self.min_token_prob = spec.suffix_decoding_min_token_prob
        self.docs: dict[int, Document] = {}  # seq_id -> its live document, from its first draft

    def _document(self, seq: Sequence) -> Document:
        doc = self.docs.get(seq.seq_id)
        if doc is None:
            doc = self.docs[seq.seq_id] = self.cache.open(seq.params.cache_salt)
        self.cache.extend(doc, seq.token_ids)
        return doc

    def propose(self, seqs: list[Sequence], ks: list[int], widths: list[int] | None = None,
                rows: Callable[[list[float]], int] | None = None) -> None:  # fmt: skip
        cache = self.cache
        for seq, k in zip(seqs, ks):
            self._document(seq)
            matched, found = cache.match(seq.params.cache_salt, seq.token_ids)
            k = min(k, int(self.max_spec_factor * matched))
            if k <= 0:
                seq.spec.clear()
                continue
            draft = draft_from(found, k, self.min_token_prob)
            if draft:
                for doc, _ in found[:4]:  # the places drafted from (the likeliest first)
                    cache.touch(doc)
            seq.spec.set(draft)

    def release(self, seq: Sequence) -> None:
        """The sequence's whole text stays in the shared index (every sequence's, whether it ever
        drafted or not: a request that ran in a large batch is as likely to recur)."""
        doc = self._document(seq)
        del self.docs[seq.seq_id]
        self.cache.close(doc)

    def forget(self) -> None:
        self.cache.clear()

    def check_no_leaks(self) -> None:
        assert not self.docs, f"suffix documents of finished sequences: {sorted(self.docs)}"
        assert self.cache.num_live == 0, f"{self.cache.num_live} live suffix documents"
        self.cache.check_integrity()
