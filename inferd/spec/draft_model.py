"""Draft-model proposals: a smaller model that shares the target's tokenizer runs ahead k tokens.

The draft keeps its own paged KV cache (its own block pool and prefix cache) and, per target
sequence, a shadow sequence whose tokens are the target's followed by the drafts of the last
proposal. Before each proposal the shadow is synced with the target: K/V of drafts the target
accepted are kept, those of rejected ones are rolled back (block table truncated). Draft tokens
are drawn the way the target samples (same processors, temperature, top-k / top-p), and their
distributions are handed to the verifier for lossless rejection sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inferd.engine.model_runner import ModelRunner
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.loader import ModelLoadError, load_model
from inferd.models import build_model
from inferd.sampling.processors import apply_processors
from inferd.sampling.rejection import DraftView
from inferd.sampling.sampler import argmax_rows, draw, sampling_distribution
from inferd.scheduler.scheduler import SchedulerOutput
from inferd.scheduler.sequence import Sequence
from inferd.spec.proposer import Proposer, ProposerContext



@dataclass(slots=True)
class _Shadow:
    seq: Sequence  # the draft's copy: the target's tokens, then the last proposal's drafts
    num_real: int  # leading tokens known to be the target's own at the last sync


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, ctx: ProposerContext) -> None:
        spec = ctx.spec
        quantization = spec.quantization or ctx.quantization
        loaded = ctx.draft_loaded or load_model(spec.model, verbose=False, quantization=quantization)
        cfg = loaded.config
        if loaded.tokenizer.hf.get_vocab() != ctx.tokenizer.hf.get_vocab():
            raise ValueError(
                f"draft model {spec.model}: its tokenizer differs from the target's; a draft "
                "model must share the target's vocabulary"
            )
        if cfg.vocab_size > ctx.model_config.vocab_size:
            raise ValueError(f"draft model {spec.model}: vocab size {cfg.vocab_size} is larger than "
                             f"the target's {ctx.model_config.vocab_size}")  # fmt: skip
        try:
            model = build_model(cfg, loaded.weights, max_positions=ctx.max_model_len,
                                dtype=ctx.dtype, device=ctx.device, quantization=quantization,
                                quantization_group_size=ctx.quantization_group_size)  # fmt: skip
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{loaded.source}: {e.args[0] if e.args else e}") from e
        # As many tokens as the target's pool: every running sequence can have its shadow.
        self.kv = KVCacheManager(ctx.num_kv_blocks, ctx.block_size, ctx.enable_prefix_caching)
        self.runner = ModelRunner(model, cfg, ctx.num_kv_blocks, ctx.block_size, ctx.dtype, ctx.device)
        self.vocab_size = ctx.model_config.vocab_size
        self.eos_token_ids = ctx.eos_token_ids
        self.shadows: dict[int, _Shadow] = {}

    # ---- per-sequence shadow state ----------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence:
        entry = self.shadows.get(seq.seq_id)
        if entry is None:
            shadow = Sequence(seq.request_id, seq.index, list(seq.token_ids), seq.num_prompt_tokens,
                              seq.params, generator=seq.generator)  # fmt: skip
            shadow.num_computed_tokens = self.kv.attach_cached_prefix(
                shadow.seq_id, shadow.token_ids, seq.params.cache_salt
            )
            self.shadows[seq.seq_id] = _Shadow(shadow, seq.num_tokens)
            return shadow
        shadow, real = entry.seq, entry.num_real
        # K/V stays valid up to the first position where the shadow's drafts and the target's
        # accepted tokens differ.
        common = real
        limit = min(shadow.num_tokens, seq.num_tokens)
        while common < limit and shadow.token_ids[common] == seq.token_ids[common]:
            common += 1
        del shadow.token_ids[real:]
        shadow.token_ids.extend(seq.token_ids[real:])
        # At least the last token is computed again: its logits give the first draft.
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, seq.num_tokens - 1)
        self.kv.truncate(shadow.seq_id, shadow.num_computed_tokens)
        entry.num_real = seq.num_tokens
        return shadow

    def release(self, seq: Sequence) -> None:
        entry = self.shadows.pop(seq.seq_id, None)
        if entry is not None:
            self.kv.free(entry.seq.seq_id)

    def check_no_leaks(self) -> None:
        assert not self.shadows, f"draft shadows left: {list(self.shadows)}"
        self.kv.check_integrity()
        assert not self.kv.block_tables, "draft block tables left"
        assert self.kv.reset_prefix_cache(), "draft prefix cache could not be flushed"
        assert self.kv.pool.num_free == self.kv.pool.num_blocks, "draft KV blocks leaked"

    # ---- proposing --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], widths: list[int] | None = None,
                rows: Callable[[list[float]], int] | None = None) -> None:  # fmt: skip
        targets: list[Sequence] = []
        depths: list[int] = []
        scheduled: list[tuple[Sequence, int]] = []
        for seq, k in zip(seqs, ks):
            shadow = self._sync(seq)
            n = shadow.num_tokens - shadow.num_computed_tokens  # catch up, then k - 1 more steps
            if self.kv.allocate_slots(shadow.seq_id, shadow.num_computed_tokens, n + k - 1):
                targets.append(seq)
                depths.append(k)
                scheduled.append((shadow, n))
        drafts: list[list[int]] = [[] for _ in targets]
        probs: list[list[torch.Tensor]] = [[] for _ in targets]
        active = list(range(len(targets)))
        first = True
        while active:
            logits, _, _ = self.runner.execute(SchedulerOutput.of(scheduled, self.kv))
            for shadow, n in scheduled:
                shadow.num_computed_tokens += n
                if first:  # only the target's own tokens go into the draft's prefix cache
                    self.kv.cache_computed_blocks(shadow.seq_id, shadow.token_ids,
                                                  shadow.num_computed_tokens, shadow.params.cache_salt)  # fmt: skip
            first = False
            views = [DraftView(targets[i], drafts[i]) for i in active]
            tokens, q = self._sample(logits, views)
            still: list[int] = []
            for j, i in enumerate(active):
                drafts[i].append(tokens[j])
                if q is not None and not targets[i].params.greedy:
                    probs[i].append(q[j])
                scheduled[j][0].token_ids.append(tokens[j])
                if len(drafts[i]) < depths[i]:
                    still.append(i)
            shadow_of = {i: scheduled[j][0] for j, i in enumerate(active)}
            scheduled = [(shadow_of[i], 1) for i in still]
            active = still
        for seq, toks, p in zip(targets, drafts, probs):
            seq.spec.set(toks, torch.stack(p) if p else None)

    def _sample(self, logits: torch.Tensor, views: list[DraftView]) -> tuple[list[int], torch.Tensor | None]:
        """Draft tokens drawn as the target would draw them; the distributions of sampled rows."""
        logits = logits[:, : self.vocab_size]
        if logits.shape[1] < self.vocab_size:  # a smaller draft vocabulary: the rest is impossible
            pad = logits.new_full((logits.shape[0], self.vocab_size - logits.shape[1]), float("-inf"))
            logits = torch.cat([logits, pad], dim=1)
        logits = apply_processors(logits, views, self.eos_token_ids)  # type: ignore[arg-type]
        tokens = argmax_rows(logits)
        random_rows = [i for i, v in enumerate(views) if not v.params.greedy]
        q = None
        if random_rows:
            q = torch.zeros_like(logits)
            q[random_rows] = sampling_distribution(logits[random_rows], [views[i] for i in random_rows])
            tokens[random_rows] = draw(q[random_rows], [views[i] for i in random_rows])
        return tokens.tolist(), q
