"""The shared index of suffix decoding: recent requests' tokens (prompt then output), one document
per sequence, indexed so that every earlier place whose tokens end the way a context ends is found
in a few dictionary reads. What a suffix tree of depth `max_depth` over the documents answers, at
a fixed cost per token indexed.

The index keys are the n-grams of lengths `NGRAM_LENGTHS` that are followed by a token:

    documents[d].tokens:   ... t[c-L] ... t[c-1] | t[c] ...
                               └─ n-gram of L ──┘   the continuation at c
    index[salt][L][hash(t[c-L:c])] -> [(d << 32) | c, ...]   in the order they were indexed
                                       (one entry: the int itself, ~80 bytes less per n-gram)

A context's longest match is looked up with its last 16, 8, 4, then 2 tokens, the first key found
giving the candidates, each extended backwards token by token up to `max_depth`; the candidates
with the longest match are the places to draft from (`match`). Keys are hashes of the n-grams
(a collision is caught by comparing the tokens).

Bounded: at most `max_tokens` tokens indexed in all and `max_requests` finished documents; a
finished document is evicted whole, least recently used first (used: added, seen again, or drafted
from). A running sequence's document (`live`) grows as the sequence does and is never evicted;
where even evicting every finished one leaves no room, it stops growing. A finished document whose
tokens equal another's under the same salt is merged into it (the other's `weight` counts both):
a recurring request costs no memory, and its continuation weighs more. A dropped document's index
entries are skipped at once and swept out a few keys at a time as tokens come and go, so the
index holds at most about twice the entries the token bound allows (and no step pauses for a pass
over all of it): with the default 131,072 tokens, ~70 MB of Python objects at most (~510 bytes a
token when no n-gram repeats; real text repeats many).

One index per cache salt (the prefix cache's tenant key, inferd.server.privacy): a document is
found only from contexts of its own salt, so no tenant drafts from another's text.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

NGRAM_LENGTHS = (2, 4, 8, 16)  # the shortest is the shortest match drafted from
_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1
# Candidates looked at per match, the most recently indexed first: a frequent short n-gram has
# thousands, and the longer keys already narrow any long match down.
MAX_CANDIDATES = 64
_MIN_STALE = 1 << 14  # dropped entries a salt's index keeps before sweeping them out
# Index entries a sweep looks at per token indexed or dropped (a key's list is looked at whole):
# it ends before the drops it races with have added a quarter of the entries it started with
# (each token dropped leaves 4 at most).
_SWEEP_PER_TOKEN = 16


@dataclass(eq=False, slots=True)
class Document:
    """One sequence's tokens, as far as they are indexed."""

    doc_id: int
    salt: str | None
    tokens: list[int] = field(default_factory=list)
    weight: int = 1  # finished requests whose tokens these were (merged)
    live: bool = True  # a running sequence's: grows, never evicted


Candidate = tuple[Document, int]  # a document and the position of the continuation in it


class SuffixCache:
    """Documents and their n-gram index, per salt, within a token and a request bound."""

    def __init__(self, max_tokens: int, max_requests: int, max_depth: int) -> None:
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.max_depth = max_depth
        self.num_tokens = 0  # tokens indexed, every document's
        self._docs: dict[int, Document] = {}
        self._finished: OrderedDict[int, Document] = OrderedDict()  # least recently used first
        self._by_content: dict[tuple[str | None, int], list[Document]] = {}  # finished ones
        # salt -> one dict per n-gram length: key hash -> entries (doc_id << 32 | position), a
        # list, or the entry alone
        self._index: dict[str | None, list[dict[int, int | list[int]]]] = {}
        self._docs_per_salt: dict[str | None, int] = {}
        # Index entries by salt: of the documents held, and left behind by dropped ones.
        self._live_entries: dict[str | None, int] = {}
        self._stale_entries: dict[str | None, int] = {}
        # salt -> a sweep's n-gram length dicts still to look at, each with the key hashes left
        # (listed when its turn comes: listing every dict at once is a pause of its own)
        self._sweeps: dict[str | None, list[tuple[dict[int, int | list[int]], list[int] | None]]] = {}
        self._next_id = 0

    # ---- documents -------------------------------------------------------------------------
    def open(self, salt: str | None) -> Document:
        """A new, empty live document under `salt`."""
        doc = Document(self._next_id, salt)
        self._next_id += 1
        self._docs[doc.doc_id] = doc
        self._docs_per_salt[salt] = self._docs_per_salt.get(salt, 0) + 1
        if salt not in self._index:
            self._index[salt] = [{} for _ in NGRAM_LENGTHS]
            self._live_entries[salt] = self._stale_entries[salt] = 0
        return doc

    def extend(self, doc: Document, token_ids: list[int]) -> None:
        """Index `token_ids[len(doc.tokens):]` (a live document grows with its sequence, whose
        tokens only ever grow), as far as the token bound leaves room."""
        start = len(doc.tokens)
        want = len(token_ids) - start
        if want <= 0 or not doc.live:
            return
        while self.num_tokens + want > self.max_tokens and self._finished:
            self._evict(next(iter(self._finished.values())))
        take = min(want, self.max_tokens - self.num_tokens)
        if take <= 0:
            return
        tokens = doc.tokens
        tokens.extend(token_ids[start : start + take])
        self.num_tokens += take
        self._live_entries[doc.salt] += _num_entries(len(tokens)) - _num_entries(start)
        self._sweep(doc.salt, take)
        index = self._index[doc.salt]
        base = doc.doc_id << _POS_BITS
        # Every n-gram that the new tokens give a continuation: the one ending just before c.
        for c in range(max(start, 1), len(tokens)):
            for length, keys in zip(NGRAM_LENGTHS, index):
                if c < length:
                    break
                h = hash(tuple(tokens[c - length : c]))
                entries = keys.get(h)
                if entries is None:
                    keys[h] = base | c
                elif type(entries) is int:
                    keys[h] = [entries, base | c]
                else:
                    entries.append(base | c)

    def close(self, doc: Document) -> None:
        """The sequence left: its document is kept as a finished one (merged into an equal one
        under the same salt), within the bounds."""
        if not doc.live:
            return
        doc.live = False
        if not doc.tokens:
            self._unindex(doc)
            return
        key = (doc.salt, hash(tuple(doc.tokens)))
        same = self._by_content.setdefault(key, [])
        for other in same:
            if other.tokens == doc.tokens:
                other.weight += doc.weight
                self.touch(other)
                self._unindex(doc)
                return
        same.append(doc)
        self._finished[doc.doc_id] = doc
        while len(self._finished) > self.max_requests:
            self._evict(next(iter(self._finished.values())))

    def touch(self, doc: Document) -> None:
        """`doc` was used: the last finished document to be evicted."""
        if not doc.live:
            self._finished.move_to_end(doc.doc_id)

    def clear(self) -> None:
        """Forget every finished document (live ones stay)."""
        for doc in list(self._finished.values()):
            self._evict(doc)
        for salt in list(self._sweeps):
            self._sweep(salt, None)

    def _evict(self, doc: Document) -> None:
        del self._finished[doc.doc_id]
        key = (doc.salt, hash(tuple(doc.tokens)))
        same = self._by_content[key]
        same.remove(doc)
        if not same:
            del self._by_content[key]
        self._unindex(doc)

    def _unindex(self, doc: Document) -> None:
        """Drop the document. Its index entries go lazily (`match` skips a dropped document's):
        filtering every list it is in at once would cost, per eviction, the length of the
        lists of every n-gram it shares with other documents (a common system prompt: all of
        them), and a pass over the whole index at once half a second at the default bound. Once
        a salt's dropped entries outnumber half its documents' own, a sweep starts over its keys,
        a few per token indexed or dropped (`_sweep`)."""
        del self._docs[doc.doc_id]
        self.num_tokens -= len(doc.tokens)
        salt = doc.salt
        self._docs_per_salt[salt] -= 1
        self._live_entries[salt] -= _num_entries(len(doc.tokens))
        if not self._docs_per_salt[salt]:
            del self._docs_per_salt[salt], self._index[salt], self._live_entries[salt]
            del self._stale_entries[salt]
            self._sweeps.pop(salt, None)
            return
        self._stale_entries[salt] += _num_entries(len(doc.tokens))
        if salt not in self._sweeps and self._stale_entries[salt] > max(self._live_entries[salt], _MIN_STALE) / 2:
            self._sweeps[salt] = [(keys, None) for keys in self._index[salt]]
        self._sweep(salt, len(doc.tokens))

    def _sweep(self, salt: str | None, tokens: int | None) -> None:
        """Remove dropped documents' entries from the keys of the salt's sweep, if one runs:
        about `_SWEEP_PER_TOKEN` entries per token (None: to its end)."""
        pending = self._sweeps.get(salt)
        if pending is None:
            return
        budget = None if tokens is None else _SWEEP_PER_TOKEN * max(1, tokens)
        docs, removed = self._docs, 0
        while pending and (budget is None or budget > 0):
            keys, hashes = pending[-1]
            if hashes is None:
                hashes = list(keys)
                pending[-1] = (keys, hashes)
            while hashes and (budget is None or budget > 0):
                h = hashes.pop()
                entries = keys.get(h)
                if entries is None:
                    continue
                if budget is not None:
                    budget -= 1 if type(entries) is int else len(entries)
                if type(entries) is int:
                    if entries >> _POS_BITS not in docs:
                        del keys[h]
                        removed += 1
                    continue
                kept = [e for e in entries if e >> _POS_BITS in docs]
                removed += len(entries) - len(kept)
                if len(kept) > 1:
                    keys[h] = kept
                elif kept:
                    keys[h] = kept[0]
                else:
                    del keys[h]
            if not hashes:
                pending.pop()
        self._stale_entries[salt] -= removed
        if not pending:
            del self._sweeps[salt]

    # ---- matching --------------------------------------------------------------------------
    def match(self, salt: str | None, context: list[int]) -> tuple[int, list[Candidate]]:
        """The longest match (p tokens, at most `max_depth`) of `context`'s end among the
        documents under `salt`, and every place it was found, the most recently indexed first;
        (0, []) when not even its last 2 tokens were seen followed by a token."""
        index = self._index.get(salt)
        n = len(context)
        if index is None:
            return 0, []
        docs, max_depth = self._docs, self.max_depth
        for length, keys in zip(reversed(NGRAM_LENGTHS), reversed(index)):
            if length > n or length > max_depth:
                continue
            entries = keys.get(hash(tuple(context[n - length :])))
            if entries is None:
                continue
            tail = context[n - length :]
            best, found = 0, []
            for e in reversed(_entries(entries)[-MAX_CANDIDATES:]):
                doc, c = docs.get(e >> _POS_BITS), e & _POS_MASK
                if doc is None:
                    continue  # dropped (evicted or merged), its entries not yet compacted
                tokens = doc.tokens
                if tokens[c - length : c] != tail:
                    continue  # another n-gram with the same hash
                m, top = length, min(max_depth, c, n)
                while m < top and tokens[c - 1 - m] == context[n - 1 - m]:
                    m += 1
                if m > best:
                    best, found = m, [(doc, c)]
                elif m == best:
                    found.append((doc, c))
            if found:
                return best, found
        return 0, []

    # ---- checks ----------------------------------------------------------------------------
    @property
    def num_finished(self) -> int:
        return len(self._finished)

    @property
    def num_live(self) -> int:
        return len(self._docs) - len(self._finished)

    def salts(self) -> set[str | None]:
        return set(self._index)

    def check_integrity(self) -> None:
        """Within the bounds, and the index holds exactly every document's n-grams."""
        assert self.num_tokens == sum(len(d.tokens) for d in self._docs.values()), "token count"
        assert self.num_tokens <= self.max_tokens, (self.num_tokens, self.max_tokens)
        assert len(self._finished) <= self.max_requests, (len(self._finished), self.max_requests)
        assert all(not d.live for d in self._finished.values()), "a live document in the LRU"
        assert sum(len(s) for s in self._by_content.values()) == len(self._finished), "merge map"
        assert set(self._index) == {d.salt for d in self._docs.values()}, "an index without documents"
        stale_total = 0
        for salt, index in self._index.items():
            docs = [d for d in self._docs.values() if d.salt == salt]
            assert self._live_entries[salt] == sum(_num_entries(len(d.tokens)) for d in docs)
            stale = 0
            for length, keys in zip(NGRAM_LENGTHS, index):
                got = [e for entries in keys.values() for e in _entries(entries)]
                held = sorted(e for e in got if e >> _POS_BITS in self._docs)
                want = sorted(
                    (d.doc_id << _POS_BITS) | c for d in docs for c in range(length, len(d.tokens))
                )
                assert held == want, length
                stale += len(got) - len(held)
                for h, entries in keys.items():
                    assert type(entries) is int or len(entries) > 1, "a one-entry list"
                    for e in _entries(entries):
                        doc, c = self._docs.get(e >> _POS_BITS), e & _POS_MASK
                        assert doc is None or hash(tuple(doc.tokens[c - length : c])) == h
            assert stale == self._stale_entries[salt], (stale, self._stale_entries[salt])
            stale_total += stale
        # Sweeps keep the dropped documents' entries to about what the token bound's own are.
        bound = len(NGRAM_LENGTHS) * self.max_tokens + _MIN_STALE
        assert stale_total <= bound, (stale_total, bound)


def _entries(value: int | list[int]) -> list[int]:
    return [value] if type(value) is int else value


def _num_entries(num_tokens: int) -> int:
    """Index entries of a document of `num_tokens` tokens (one per n-gram length and position
    that has at least that many tokens before it)."""
    return sum(max(0, num_tokens - length) for length in NGRAM_LENGTHS)
