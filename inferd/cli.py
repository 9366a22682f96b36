"""The `inferd` command: generate, chat, info, serve, router, bench."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inferd.engine_args import add_engine_args, engine_config_from_args
from inferd.logging_setup import configure_logging

if TYPE_CHECKING:
    from inferd.loader.tokenizer import Tokenizer

# Enough for a full answer from a chat model, which ends its turn itself; a cap for --raw text.
DEFAULT_MAX_TOKENS = 512


def _sampling_args(
    parser: argparse.ArgumentParser, temperature: float, repetition_penalty: float
) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="most tokens to generate (default: %(default)s; a chat model usually "
                   "ends its turn first)")  # fmt: skip
    g.add_argument("--temperature", type=float, default=temperature,
                   help="0 = greedy (default: %(default)s)")  # fmt: skip
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest (default: 0 = off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens under min-p x the top token's probability "
                   "(default: 0 = off)")  # fmt: skip
    g.add_argument("--repetition-penalty", type=float, default=repetition_penalty,
                   help="> 1 makes every token already in the prompt or output less likely; "
                   "1 = off (default: %(default)s)")  # fmt: skip
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token already generated, -2 to 2 "
                   "(default: 0)")  # fmt: skip
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted once per earlier occurrence in the output, -2 to 2 "
                   "(default: 0)")  # fmt: skip
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of this request's sampling: the same output at "
                   "temperature > 0")  # fmt: skip
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from inferd.sampling.params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed, stop=args.stop,
    )  # fmt: skip


def _build_engine(args: argparse.Namespace):
    from inferd.engine.core import EngineCore

    engine = EngineCore(engine_config_from_args(args))
    if args.chat_template:
        with open(args.chat_template) as f:
            engine.tokenizer.set_chat_template(f.read())
    return engine


@dataclass(slots=True)
class _StreamResult:
    tokens: int = 0
    ttft: float | None = None  # seconds from submission to the first token
    first_token_wall: float | None = None  # time.time() of the first token
    seconds: float = 0.0


def _stream(engine, prompt, params, out=sys.stdout) -> _StreamResult:
    """Run one request to completion, printing text as it arrives."""
    rid = f"cli-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    res = _StreamResult()
    try:
        while True:
            deltas = engine.step()
            for d in deltas:
                if d.request_id != rid:
                    continue
                if res.ttft is None:
                    res.ttft = time.perf_counter() - start
                    res.first_token_wall = time.time()
                res.tokens += len(d.new_token_ids)
                out.write(d.text_delta)
                out.flush()
            if rid not in engine.requests or engine.requests[rid].finished:
                break
    except KeyboardInterrupt:
        engine.abort_request(rid)
        raise
    if rid in engine.requests:
        engine.pop_finished(rid)
    res.seconds = time.perf_counter() - start
    return res


def generate_prompt(tokenizer: Tokenizer, text: str, raw: bool) -> tuple[list[int], bool]:
    """The token ids `inferd generate` sends for `text`, and whether they are the chat template's:
    the model's template around one user turn (what an instruct model was trained on) unless
    `raw` or the model has none, else `text` as a plain completion."""
    if raw or not tokenizer.chat_template:
        return tokenizer.encode(text), False
    turn = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(turn, add_special_tokens=False), True


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _build_engine(args)
    params = _sampling_params(args)
    text = args.prompt
    if text is None or text == "-":
        text = sys.stdin.read()
    prompt, templated = generate_prompt(engine.tokenizer, text, args.raw)
    if not templated:
        sys.stdout.write(text)  # a completion continues the prompt: show both
    res = _stream(engine, prompt, params)
    sys.stdout.write("\n")
    if res.ttft is not None:
        n, ttft, secs = res.tokens, res.ttft, res.seconds
        decode = (n - 1) / (secs - ttft) if n > 1 and secs > ttft else 0.0
        startup = res.first_token_wall - _process_start_time()
        print(f"[{n} tokens; time to first token {ttft * 1000:.0f} ms; decode {decode:.1f} tokens/s; "
              f"process start to first token {startup:.2f} s]", file=sys.stderr)  # fmt: skip
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _build_engine(args)
    params = _sampling_params(args)
    tok = engine.tokenizer
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("inferd chat — /reset clears the conversation, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(history), add_special_tokens=False)
        if len(ids) >= engine.max_model_len:
            print(f"[conversation is {len(ids)} tokens, over the {engine.max_model_len}-token "
                  "context; /reset to start again]", file=sys.stderr)  # fmt: skip
            history.pop()
            continue
        reply = []

        class _Tee:
            def write(self, s: str) -> None:
                reply.append(s)
                sys.stdout.write(s)

            def flush(self) -> None:
                sys.stdout.flush()

        try:
            _stream(engine, ids, params, out=_Tee())
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def _kv_bytes_row(cfg, dtype) -> str:
    """Per --kv-cache-dtype: bytes a token takes in the pool, and tokens held against `auto`."""
    from inferd.kv.kv_cache import kv_bytes_per_token

    auto = kv_bytes_per_token(cfg, dtype, "auto")
    parts = [f"auto {auto:,} ({str(dtype).removeprefix('torch.')})"]
    for name in ("float16", "int8", "fp8"):
        n = kv_bytes_per_token(cfg, dtype, name)
        parts.append(f"{name} {n:,} ({auto / n:.2f}x the tokens)")
    return " · ".join(parts)


def _kv_hybrid_row(cfg, spec, dtype, context: int = 8192) -> str:
    """KV bytes per token of a `context`-token sequence with the hybrid KV manager (windowed
    layers keep their window only) and without (every layer every token)."""
    from inferd.kv.kv_cache import kv_bytes_per_token
    from inferd.kv.kv_groups import KVLayout, kv_bytes_per_token_at

    layer_bytes = kv_bytes_per_token(cfg, dtype, "auto") // cfg.num_layers
    full = kv_bytes_per_token_at(spec, layer_bytes, context, hybrid=False)
    layout = KVLayout.of(spec)
    if not layout.is_hybrid:
        return f"{full:,.0f} B/token (no sliding-window layers: every layer holds every token)"
    hybrid = kv_bytes_per_token_at(spec, layer_bytes, context, hybrid=True)
    local = [layer.sliding_window for layer in spec.layers if layer.is_local]
    held = ", ".join(f"{n} local layers hold {w} tokens" for w, n in
                     sorted({w: local.count(w) for w in local}.items()))  # fmt: skip
    return f"{hybrid:,.0f} B/token (hybrid: {held}), {full:,.0f} without · {layout.describe()}"


def _memory_plan_row(loaded, device, dtype) -> str:
    """What `inferd serve` on `device` with default flags would plan (inferd/engine/memory_plan.py),
    the activations estimated from the shapes (serving measures them with a profiling forward)."""
    from inferd.config import CacheConfig, SchedulerConfig
    from inferd.engine.memory_plan import estimate_activation_bytes, plan_kv_memory
    from inferd.kv.kv_cache import kv_bytes_per_token
    from inferd.quantization.policy import weight_bytes_by_mode

    cfg, cache, sched = loaded.config, CacheConfig(), SchedulerConfig()
    weights = weight_bytes_by_mode(loaded.weights, cfg.tie_word_embeddings)["auto"]
    per_token = kv_bytes_per_token(cfg, dtype)
    try:
        plan = plan_kv_memory(cache, device, weight_bytes=weights, to_load_bytes=weights,
                              activation_bytes=estimate_activation_bytes(
                                  cfg, dtype, sched.max_num_batched_tokens, sched.max_num_seqs),
                              activation_source="estimated", bytes_per_block=per_token * cache.block_size)  # fmt: skip
    except ValueError as e:
        return str(e)
    return f"{plan.describe()} ≈ {plan.num_blocks * cache.block_size:,} tokens (default flags, -q auto)"


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from inferd.config import resolve_device, resolve_dtype
    from inferd.loader import load_model
    from inferd.quantization.policy import weight_bytes_by_mode

    from inferd.loader import ModelLoadError
    from inferd.models import model_spec

    tokenizer_note = None
    try:
        loaded = load_model(args.model, quantization="auto")  # GGUF blocks as shipped
    except ModelLoadError as e:  # a tokenizer inferd cannot build: the model's facts still are
        loaded = load_model(args.model, quantization="auto", with_tokenizer=False)
        tokenizer_note = f"not supported ({e})"
    cfg = loaded.config
    spec = model_spec(cfg)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    rows = [
        ("model", loaded.source),
        ("name", cfg.name or "-"),
        ("architecture", cfg.architecture),
        ("weights", loaded.file_type),
        ("parameters", f"{cfg.num_parameters():,} ({cfg.num_parameters() / 1e6:.1f} M)"
                       + (f", {cfg.num_active_parameters() / 1e6:.1f} M active per token" if cfg.num_experts else "")),
        ("layers / hidden / ffn", f"{cfg.num_layers} / {cfg.hidden_size} / {cfg.intermediate_size}"),
        ("heads (q / kv) × dim", f"{cfg.num_heads} / {cfg.num_kv_heads} × {cfg.head_dim}" if not cfg.is_mla
         else f"{cfg.num_heads} × (q/k {cfg.qk_nope_head_dim} + rope {cfg.head_dim}, v {cfg.v_head_dim}); "
              f"KV: latent {cfg.kv_lora_rank} + rope {cfg.head_dim}"),
        ("attention", spec.summary()),
        ("layer", spec.traits()),
        ("vocab", str(cfg.vocab_size)),
        ("context length", str(cfg.max_position_embeddings)),
        ("rope theta / scaling", f"{cfg.rope_theta:g} / {cfg.rope_scaling or 'none'}"),
        ("tied embeddings", str(cfg.tie_word_embeddings)),
        ("compute dtype", f"{str(dtype).removeprefix('torch.')} on {device}"),
        ("KV bytes per token", _kv_bytes_row(cfg, dtype)),
        ("KV at 8k context", _kv_hybrid_row(cfg, spec, dtype)),
        ("resident weights", " · ".join(
            f"{m} {b / 2**20:.1f} MiB" for m, b in
            weight_bytes_by_mode(loaded.weights, cfg.tie_word_embeddings).items())),  # fmt: skip
        ("memory plan", _memory_plan_row(loaded, device, dtype)),
        ("chat template", tokenizer_note or ("yes" if loaded.tokenizer.chat_template else "no")),
        ("torch", torch.__version__),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferd", description="LLM inference and serving engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt ('-' or none: stdin)")
    p.add_argument("--raw", action="store_true",
                   help="plain completion: send the prompt as it is (default: inside the model's "
                   "chat template, as one user turn, where the model has one)")  # fmt: skip
    p.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # the default now
    add_engine_args(p)
    # Greedy answers of a small instruct model tend to loop ("la femme au roi, la femme au roi,
    # ..."); 1.1 stops that, as llama.cpp's long-standing default does, and keeps greedy's
    # determinism. Chat samples instead, and a penalty over a whole conversation's words would
    # grow with it.
    _sampling_args(p, temperature=0.0, repetition_penalty=1.1)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat using the model's chat template")
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_args(p)
    _sampling_args(p, temperature=0.7, repetition_penalty=1.0)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("info", help="architecture, parameters, dtype, context, KV bytes per token")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_info)

    try:  # the server and bench live in their own packages
        from inferd.server.cli import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    try:
        from inferd.router.cli import add_router_parser
    except ImportError:
        pass
    else:
        add_router_parser(sub)
    try:
        from inferd.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def _process_start_time() -> float:
    """When the OS started this process (imports included), for the startup figure."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil missing or unsupported platform: module import time instead
        return _MODULE_IMPORTED


_MODULE_IMPORTED = time.time()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level.upper())
    try:
        result = args.func(args)
        return result if isinstance(result, int) else 0
    except (FileNotFoundError, ValueError) as e:
        print(f"inferd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
