"""inferd and the peers it is measured against, each timed token by token on the same token ids.

- inferd: requests added to an `EngineCore` together, the time of every step that produced tokens
  recorded (same stamps as the peers').
- HF transformers: `generate` with static batching (left-padded), "the traditional way" of the
  seeds. A logits processor stamps the time of every step, so one `generate` call yields the time
  to first token and every inter-token gap of the real thing.
- llama.cpp through `llama-cpp-python` (optional: `pip install llama-cpp-python` builds it). Its
  `Llama` API runs one sequence at a time; where a scenario needs concurrency it is said so and
  the peer runs what it can (one sequence). `gguf_copy` makes an F32 or Q8_0 copy of a GGUF with
  `llama_model_quantize`, so each precision of inferd meets the same precision of llama.cpp.
- OpenVINO GenAI (optional: `pip install openvino-genai`): its continuous-batching pipeline on
  the same GGUF, stepped like inferd (inferd/bench/openvino_peer.py).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

PEERS = ("hf", "llama.cpp", "openvino")
LLAMA_CPP_MISSING = (
    "llama.cpp peer skipped: llama-cpp-python is not installed (pip install llama-cpp-python)"
)


def parse_peers(spec: str) -> set[str]:
    """`--peers hf,llama.cpp` (or `none`) as a set; unknown names are a clear error."""
    names = {p.strip() for p in spec.split(",") if p.strip()} - {"none"}
    unknown = names - set(PEERS)
    if unknown:
        raise ValueError(
            f"unknown peer(s) {sorted(unknown)}; choose from {', '.join(PEERS)} or none"
        )
    return names


@dataclass(slots=True)
class Timed:
    """One generation call, timed from its start: `stamps[i]` is when step i's tokens were ready;
    `first[j]` when request j had its first token (requests of one static batch share it)."""

    start: float
    stamps: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    end: float = 0.0
    token_ids: list[list[int]] = field(default_factory=list)  # inferd and openvino: the outputs

    @property
    def request_ttft_s(self) -> list[float]:
        return [f - self.start for f in self.first]

    @property
    def ttft_s(self) -> float:
        return self.stamps[0] - self.start

    @property
    def step_s(self) -> list[float]:
        """Gaps between consecutive tokens (the decode steps)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    @property
    def decode_tps(self) -> float:
        """Tokens/s per sequence after the first token."""
        n = len(self.stamps) - 1
        return n / (self.stamps[-1] - self.stamps[0]) if n > 0 else 0.0

    @property
    def total_s(self) -> float:
        return self.end - self.start


# ---- inferd ----------------------------------------------------------------------------------


def inferd_generate_timed(engine, prompts: list[list[int]], output_len: int,
                          temperature: float = 0.0, top_p: float = 1.0, loras: list | None = None) -> Timed:  # fmt: skip
    """All `prompts` added at once, greedy (or sampled at `temperature`, `top_p`), exactly
    `output_len` tokens each (prompt i under LoRA adapter `loras[i]` when given); `stamps` are the
    ends of the steps that produced tokens (the first is the end of the prefill when the batch's
    prompts fit one step's token budget)."""
    from inferd.sampling.params import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=output_len, ignore_eos=True)
    tag = time.monotonic_ns()
    ids = [f"bench-{tag}-{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    first: dict[int, float] = {}
    timed = Timed(time.perf_counter())
    for i, (rid, p) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, p, params, prompt_token_ids=p, lora_request=loras[i] if loras else None)
    while engine.has_unfinished_requests():
        deltas = engine.step()
        if deltas:
            now = time.perf_counter()
            timed.stamps.append(now)
            for d in deltas:
                first.setdefault(index[d.request_id], now)
    timed.end = time.perf_counter()
    timed.first = [first[i] for i in range(len(ids))]
    timed.token_ids = [engine.pop_finished(rid).outputs[0].token_ids for rid in ids]
    return timed


# ---- HF transformers ------------------------------------------------------------------------


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    """HF's model for a GGUF file (dequantised to `dtype` by transformers) or an HF directory."""
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        )
    return model.eval()


class _Stamp:
    """A logits processor that only records when each step's logits are ready."""

    def __init__(self, timed: Timed) -> None:
        self.timed = timed

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.timed.stamps.append(time.perf_counter())
        return scores


def hf_generate_timed(model, prompts: list[list[int]], output_len: int, pad_id: int) -> Timed:
    """Static batch of `prompts` (left padded), greedy, exactly `output_len` new tokens each."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    timed = Timed(time.perf_counter())
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                       do_sample=False, pad_token_id=pad_id,
                       logits_processor=LogitsProcessorList([_Stamp(timed)]))  # fmt: skip
    timed.end = time.perf_counter()
    timed.first = [timed.stamps[0]] * len(prompts)
    return timed


def hf_kv_bytes(model, context_len: int, batch: int = 1) -> int:
    """Bytes of HF's KV cache (a dense [batch, kv_heads, context, head_dim] pair per layer)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    return (
        2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * context_len * head_dim * elem
    )


# ---- llama.cpp ------------------------------------------------------------------------------


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def gguf_copy(src: Path, ftype: str, threads: int | None = None) -> Path:
    """An F32 or Q8_0 copy of `src` made by llama.cpp's own quantizer, cached next to inferd's
    converted weights; `ftype="same"` returns `src` itself."""
    if ftype == "same":
        return src
    import llama_cpp

    from inferd.loader.default_model import cache_dir

    types = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    if ftype not in types:
        raise ValueError(f"unknown GGUF type {ftype!r}; one of {sorted(types)} or 'same'")
    out = cache_dir() / "models" / f"{src.stem}.{ftype.upper()}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = types[ftype]
    params.allow_requantize = True  # the source is itself quantized (the default model is Q4_1)
    params.nthread = threads or torch.get_num_threads()
    partial = out.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(
        str(src).encode(), str(partial).encode(), ctypes.byref(params)
    )
    if rc != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} → {ftype}) failed with code {rc}")
    partial.replace(out)  # atomic: a killed run never leaves a truncated copy
    return out


class LlamaCppPeer:
    """llama.cpp's `Llama` on one GGUF: one sequence at a time, greedy, EOS ignored."""

    def __init__(self, gguf: Path, n_ctx: int = 2048, threads: int | None = None) -> None:
        from llama_cpp import Llama

        threads = threads or torch.get_num_threads()
        self.path = gguf
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)  # fmt: skip

    def generate_timed(self, prompt: list[int], output_len: int, keep_cache: bool = False) -> Timed:
        """`keep_cache`: reuse the KV of the longest prefix this context evaluated last (what
        llama.cpp does by itself in a conversation); otherwise the prompt is computed afresh."""
        if not keep_cache:
            self.llm.reset()
        timed = Timed(time.perf_counter())
        # reset=True: start from the longest prefix of the last evaluated tokens that `prompt`
        # shares (none after `reset()`); `generate` never stops by itself (no EOS check).
        for _ in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            timed.stamps.append(time.perf_counter())
            if len(timed.stamps) == output_len:
                break
        timed.end = time.perf_counter()
        timed.first = timed.stamps[:1]
        return timed

    def close(self) -> None:
        self.llm.close()


def peer_gguf_type(quantization: str) -> str:
    """The llama.cpp copy whose precision matches inferd's `--quantization`: fp32 for `none`,
    Q8_0 for `int8`, the file as shipped for `auto` (inferd keeps its blocks too)."""
    return {"none": "f32", "int8": "q8_0"}.get(quantization, "same")


# ---- the set a bench asked for ---------------------------------------------------------------


class PeerSet:
    """The peers one bench run asked for, loaded on first use; what could not run is a note."""

    def __init__(self, path: Path, wanted: set[str], quantization: str, pad_id: int) -> None:
        self.path, self.wanted, self.quantization, self.pad_id = path, wanted, quantization, pad_id
        self.notes: list[str] = []
        self._hf = None
        self._llama: LlamaCppPeer | None = None
        self._openvino = None
        self._check_openvino()
        if "llama.cpp" in wanted and not llama_cpp_available():
            self.notes.append(LLAMA_CPP_MISSING)
            self.wanted = wanted - {"llama.cpp"}
        elif "llama.cpp" in wanted and path.suffix != ".gguf":
            self.notes.append("llama.cpp peer skipped: the model is not a GGUF file")
            self.wanted = wanted - {"llama.cpp"}

    def _check_openvino(self) -> None:
        from inferd.bench.openvino_peer import OPENVINO_MISSING, openvino_available

        if "openvino" not in self.wanted:
            return
        if not openvino_available():
            self.notes.append(OPENVINO_MISSING)
        elif self.path.suffix != ".gguf":
            self.notes.append("openvino peer skipped: the model is not a GGUF file")
        else:
            return
        self.wanted = self.wanted - {"openvino"}

    def openvino(self, max_num_seqs: int, max_num_batched_tokens: int = 2048):
        """OpenVINO GenAI's pipeline for at least `max_num_seqs` concurrent sequences (re-created
        when it must grow), or None when not asked for or not installed."""
        if "openvino" not in self.wanted:
            return None
        from inferd.bench.openvino_peer import OpenVinoPeer

        if self._openvino is not None and self._openvino.max_num_seqs < max_num_seqs:
            self._openvino.close()
            self._openvino = None
        if self._openvino is None:
            self._openvino = OpenVinoPeer(self.path, max_num_seqs, max_num_batched_tokens)
            self._openvino.generate_timed([[self.pad_id] * 4], 2)  # warm-up (its first step compiles)
            note = (f"openvino runs {self.path.name} (converted at load; its CPU plugin's own "
                    "precisions), prefix caching off")  # fmt: skip
            if note not in self.notes:
                self.notes.append(note)
        return self._openvino

    def hf(self):
        if "hf" not in self.wanted:
            return None
        if self._hf is None:
            self._hf = load_hf(self.path)
            hf_generate_timed(self._hf, [[self.pad_id] * 4], 2, self.pad_id)  # warm-up
            if self.quantization != "none":
                self.notes.append("hf runs fp32 weights (transformers dequantises the GGUF)")
        return self._hf

    def llama_cpp(self, n_ctx: int) -> LlamaCppPeer | None:
        """llama.cpp with a context of at least `n_ctx` tokens (re-created when it must grow)."""
        if "llama.cpp" not in self.wanted:
            return None
        if self._llama is not None and self._llama.llm.n_ctx() < n_ctx:
            self._llama.close()
            self._llama = None
        if self._llama is None:
            ftype = peer_gguf_type(self.quantization)
            self._llama = LlamaCppPeer(gguf_copy(self.path, ftype), n_ctx=n_ctx)
            self._llama.generate_timed([self.pad_id] * 4, 2)  # warm-up
            note = f"llama.cpp runs {self._llama.path.name} ({'as shipped' if ftype == 'same' else ftype})"
            if note not in self.notes:
                self.notes.append(note)
        return self._llama

    def close(self) -> None:
        if self._llama is not None:
            self._llama.close()
            self._llama = None
        if self._openvino is not None:
            self._openvino.close()
            self._openvino = None
