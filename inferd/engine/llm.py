"""`LLM`: the offline batch API, shaped like vLLM's (`generate`, `chat`) so scripts port unchanged."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any, Self

from tqdm import tqdm

from inferd.config import EngineConfig
from inferd.engine.core import KV_POLL_S, EngineCore, RequestError
from inferd.engine.llm_replicas import ReplicaPool
from inferd.engine.outputs import RequestOutput
from inferd.engine.stats import EngineStats
from inferd.engine_args import build_engine_config
from inferd.loader import Tokenizer
from inferd.lora.request import LoRARequest
from inferd.sampling.params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


def _normalize_prompts(prompts: PromptType | Seq[PromptType]) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [prompts]  # one prompt given as token ids
    out: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append(list(p["prompt_token_ids"]))
            elif "prompt" in p:
                out.append(p["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        else:
            out.append(p)
    return out


class LLM:
    """Offline inference: `LLM(model).generate(prompts, SamplingParams(...))`.

    Keyword arguments are the engine arguments, named as vLLM names them (block_size,
    max_num_seqs, max_num_batched_tokens, max_model_len, kv_cache_memory, dtype, device, seed,
    speculative_config, ...: `inferd.engine_args.ENGINE_ARGS`, the CLI's engine flags), with the
    same defaults but one: stats log lines are off (`log_stats_interval=0`) unless asked for.
    An unknown keyword raises TypeError. `chat_template` is a Jinja template (text), `verbose`
    prints the engine's start-up lines, `loaded` is an already loaded model to serve.

    `data_parallel_size=N` (N > 1) runs N engine replicas in processes of their own, each on its
    share of the cores (inferd/engine/llm_replicas.py): each prompt goes to one replica, chosen by
    the cache-aware routing policy, and the outputs come back in prompt order. `engine` is then
    None; `close()` (or dropping the LLM) stops the replicas.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        chat_template: str | None = None,
        verbose: bool = True,
        loaded: Any = None,
        data_parallel_size: int = 1,
        **engine_args: Any,
    ) -> None:
        config = self.engine_config(model, **engine_args)
        self._ids = itertools.count()
        self.engine: EngineCore | None = None
        self.replicas: ReplicaPool | None = None
        if data_parallel_size != 1:
            if loaded is not None:
                raise ValueError("LLM(data_parallel_size > 1) loads the model in each replica: "
                                 "give a model path, not `loaded`")  # fmt: skip
            self.replicas = ReplicaPool(config, data_parallel_size, verbose=verbose)
            self._tokenizer = self.replicas.tokenizer
        else:
            self.engine = EngineCore(config, loaded=loaded, verbose=verbose)
            self._tokenizer = self.engine.tokenizer
        if chat_template is not None:
            self._tokenizer.set_chat_template(chat_template)

    @staticmethod
    def engine_config(model: str | None = None, **engine_args: Any) -> EngineConfig:
        """The EngineConfig `LLM(model, **engine_args)` runs, built without loading anything."""
        engine_args.setdefault("log_stats_interval", 0.0)  # offline: no periodic log lines
        try:
            return build_engine_config(model=model, **engine_args)
        except TypeError as e:
            raise TypeError(f"LLM(): {e}") from None

    def get_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order. Invalid prompts raise before anything runs.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model; needs `enable_lora=True`)."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"{len(loras)} LoRA requests for {len(prompt_list)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompt_list]
        if self.replicas is not None:
            if any(lr is not None for lr in loras):
                raise ValueError("lora_request with data_parallel_size > 1 is not supported")
            return self.replicas.generate(ids, prompt_list, params_list, priorities, use_tqdm)
        token_ids = validate_prompts(self.engine, prompt_list, params_list)
        return run_prompts(self.engine, ids, prompt_list, token_ids, params_list, priorities,
                           use_tqdm, loras)  # fmt: skip

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self._tokenizer
        if chat_template is not None:
            tok = _with_template(tok, chat_template)
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            # The template already wrote any BOS it wants: do not add another.
            prompts.append(tok.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Flush the prefix cache (every replica's); True when it is empty afterwards."""
        if self.replicas is not None:
            return self.replicas.reset_prefix_cache()
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers or the replicas, if any (also done when the
        LLM is collected, and at exit)."""
        if self.replicas is not None:
            self.replicas.close()
        else:
            self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_stats(self) -> EngineStats:
        """Running / waiting / preempted counts, KV usage, token totals and throughputs (with
        replicas: their sums, the KV usage over all their blocks)."""
        if self.replicas is not None:
            return self.replicas.get_stats()
        return self.engine.get_stats()


def validate_prompts(
    engine: EngineCore, prompts: list[str | list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    """Each prompt's token ids; ValueError naming the first invalid prompt. Structured-output
    grammars compile here (cached), under their time limit, before anything runs."""
    token_ids: list[list[int]] = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        try:
            token_ids.append(engine.validate(p, sp))
            if sp.structured is not None:
                engine.prepare_structured(sp)
        except RequestError as e:
            raise ValueError(f"prompt {i}: {e}") from e
    return token_ids


def run_prompts(
    engine: EngineCore,
    ids: list[str],
    prompts: list[str | list[int]],
    token_ids: list[list[int]],
    params: list[SamplingParams],
    priorities: list[int],
    use_tqdm: bool,
    loras: list[LoRARequest | None] | None = None,
) -> list[RequestOutput]:
    """Add the (validated) requests and step until each has finished: their outputs in order.
    `loras`: each prompt's LoRA adapter (None: the base model); an adapter that does not load
    raises ValueError before anything of this call runs."""
    loras = loras or [None] * len(ids)
    for i, (rid, p, toks, sp, prio) in enumerate(zip(ids, prompts, token_ids, params, priorities)):
        try:
            engine.add_request(rid, p, sp, priority=prio, prompt_token_ids=toks, lora_request=loras[i])
        except RequestError as e:
            for added in ids[:i]:
                engine.abort_request(added)
            raise ValueError(f"prompt {i}: {e}") from e
    done: dict[str, RequestOutput] = {}
    bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm)
    try:
        while engine.has_unfinished_requests():
            if not engine.has_runnable_requests():
                time.sleep(KV_POLL_S)  # only KV loads in flight: leave their thread the CPU
            for delta in engine.step():
                state = engine.requests.get(delta.request_id)
                if delta.finished and state is not None and state.finished:
                    done[delta.request_id] = engine.pop_finished(delta.request_id)
                    bar.update(1)
    except BaseException:
        for rid in ids:  # KeyboardInterrupt or an error: leave no request holding blocks
            engine.abort_request(rid)
        raise
    finally:
        bar.close()
    return [done[rid] for rid in ids]


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    clone = Tokenizer(tok.hf, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids,
                      add_bos_token=tok.add_bos_token, chat_template=template)  # fmt: skip
    return clone
