"""`inferd bench prefix --scenario kv-tier`: the 5-turn chat's fifth turn after a restart, its
history loaded from the disk KV tier, against the same turn recomputed cold and served warm from
memory — in one run, engines taking turns.

Per run: engine A (with a tier in a fresh directory) holds the conversation turn by turn, then
answers turn 5 again from its memory: the warm figure (the same prompt the other two answer; the
first answer of turn 5 computed its new user message, which a replay does not). A closes (its
prefix cache goes to the tier: what a restarted server finds). Engine B starts on the same
directory and answers turn 5 again: the disk figure. Engine C, without a tier and with an empty
cache, answers it: the cold figure. Targets: disk / cold ≤ 0.3.
"""

from __future__ import annotations

import statistics
import tempfile
import time

KV_CACHE_MEMORY = 256 << 20  # each engine's pool: the conversation fits; three engines at once do


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    from inferd import SamplingParams

    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                          use_tqdm=False)  # fmt: skip
    return out.metrics.first_token_time - out.metrics.arrival_time, out.metrics.num_cached_tokens


def run_kv_tier(args, loaded, tok, clock) -> dict:
    from inferd import LLM
    from inferd.bench.prefix import multi_turn

    def engine(**kw):
        llm = LLM(loaded=loaded, verbose=False, kv_cache_memory=KV_CACHE_MEMORY,
                  max_num_batched_tokens=args.max_num_batched_tokens, **kw)  # fmt: skip
        if clock is not None:
            llm.engine.clock = clock
        llm.generate([[1, 2, 3]], use_tqdm=False)  # warm-up
        return llm

    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="inferd-kv-tier-") as tier:
            a = engine(kv_offload_dir=tier)
            conv = multi_turn(
                a, tok, turns=5, turn_tokens=args.turn_tokens, answer_tokens=args.answer_tokens
            )
            prompt = conv["final_prompt"]
            warm, warm_cached = _ttft(a, prompt)
            a.close()
            del a
            b = engine(kv_offload_dir=tier)
            start = time.perf_counter()
            disk, disk_cached = _ttft(b, prompt)
            stats = b.engine.connector.stats()
            b.close()
            del b
            c = engine()
            cold, _ = _ttft(c, prompt)
            c.close()
            del c
            runs.append({"warm_s": warm, "disk_s": disk, "cold_s": cold,
                         "first_answer_s": conv["ttft_per_turn_s"][-1],
                         "warm_cached_tokens": warm_cached, "disk_cached_tokens": disk_cached,
                         "prompt_tokens": len(prompt),
                         "bytes_read": stats["kv_offload_bytes_read"],
                         "disk_wall_s": time.perf_counter() - start})  # fmt: skip
    med = {k: statistics.median(r[k] for r in runs)
           for k in ("warm_s", "disk_s", "cold_s", "first_answer_s")}  # fmt: skip
    report = {
        "prompt_tokens": runs[0]["prompt_tokens"],
        "warm_cached_tokens": runs[0]["warm_cached_tokens"],
        "disk_cached_tokens": runs[0]["disk_cached_tokens"],
        "bytes_read_per_run": runs[0]["bytes_read"],
        "turn5_ttft_warm_s": round(med["warm_s"], 4),
        "turn5_ttft_disk_s": round(med["disk_s"], 4),
        "turn5_ttft_cold_s": round(med["cold_s"], 4),
        "turn5_first_answer_ttft_s": round(med["first_answer_s"], 4),
        "disk_over_cold": round(med["disk_s"] / med["cold_s"], 4),
        "disk_over_warm": round(med["disk_s"] / med["warm_s"], 4),
        "disk_over_cold_per_run": [round(r["disk_s"] / r["cold_s"], 4) for r in runs],
    }
    print(f"5-turn chat, turn 5 ({report['prompt_tokens']} tokens; {report['disk_cached_tokens']} from the tier "
          f"after a restart): TTFT warm memory {med['warm_s']:.3f} s, disk {med['disk_s']:.3f} s, cold "
          f"{med['cold_s']:.3f} s (its first answer, new message computed: {med['first_answer_s']:.3f} s) → disk/cold {report['disk_over_cold']}×, disk/warm {report['disk_over_warm']}×")  # fmt: skip
    return report
