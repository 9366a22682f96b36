"""Run every `inferd bench` against its peers and write one JSON and one markdown result.

    python benchmarks/run_all.py [--quick] [--only roofline,latency-fp32,...] [--out DIR]

Each bench runs as its own process (`python -m inferd.cli bench ...`, the exact command is in
the result) and its last stdout line, one JSON document, is kept. The machine's load (`uptime`)
is recorded before and after each bench: on a shared machine the figures are only comparable
within one bench, where the peers run interleaved in the same process. Results go to
`benchmarks/results/` (not committed); README quotes the figures it keeps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING"]

# name → (bench argv, the argv's --quick replacements)
BENCHES: dict[str, tuple[list[str], list[str]]] = {
    "roofline": (["roofline", "--model-limits"], ["--budget-s", "1"]),
    "latency-fp32": (["latency", "--runs", "3"], ["--runs", "1", "--output-len", "32"]),
    "latency-q-auto": (["latency", "-q", "auto", "--runs", "3"], ["--runs", "1", "--output-len", "32"]),
    "throughput": (["offline", "--scenario", "throughput"],
                   ["--runs", "1", "--num-prompts", "8", "--output-len", "32"]),
    "multi-turn": (["offline", "--scenario", "multi-turn"], ["--runs", "1", "--output-len", "16"]),
    "shared-prefix": (["offline", "--scenario", "shared-prefix"],
                      ["--runs", "1", "--num-prompts", "8", "--prefix-len", "256"]),
    "long-context": (["offline", "--scenario", "long-context", "--peers", "hf,llama.cpp"],
                     ["--context-lens", "256,1024", "--output-len", "16"]),
    "structured": (["structured", "--runs", "3"], ["--runs", "1", "--batch", "8", "--max-tokens", "32"]),
    "serve": (["serve", "--concurrency", "1,8,32", "--num-prompts", "32", "--input-len", "128",
               "--output-len", "64", "--ignore-eos"],
              ["--concurrency", "1,8", "--num-prompts", "8", "--output-len", "16"]),
}  # fmt: skip


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(extra: list[str]) -> Iterator[str]:
    """`inferd serve` on a free port until the block ends; yields its base URL."""
    import httpx

    port = _free_port()
    cmd = [*CLI, "serve", "--port", str(port), "--disable-log-requests", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"inferd serve exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        else:
            raise RuntimeError("inferd serve did not become healthy in 300 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _with_flags(argv: list[str], flags: list[str]) -> list[str]:
    """`argv` with each `--flag value` of `flags` replacing the same flag's value, or appended."""
    out = list(argv)
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def run_bench(
    name: str, quick: bool, timeout: float, model: str | None = None, threads: int = 0
) -> dict:
    argv, quick_argv = BENCHES[name]
    if quick:
        argv = _with_flags(argv, quick_argv)
    if threads and argv[0] in ("roofline", "latency", "offline"):
        argv += ["--threads", str(threads)]
    server_args = ["-q", "auto"]
    if model:  # the server takes it as its positional argument; bench serve sizes prompts with it
        argv += ["--tokenizer", model] if name == "serve" else ["--model", model]
        server_args.insert(0, model)
    entry: dict = {"name": name, "load_before": _load()}
    t0 = time.monotonic()
    with _server(server_args) if name == "serve" else contextlib.nullcontext() as url:
        cmd = [*CLI, "bench", *argv] + (["--base-url", url] if url else [])
        entry["command"] = "inferd bench " + shlex.join(argv) + (" --base-url URL" if url else "")
        if url:
            entry["command"] = "inferd serve -q auto --disable-log-requests & " + entry["command"]
        print(
            f"[{name}] {entry['command']}  (load {entry['load_before']})",
            file=sys.stderr,
            flush=True,
        )
        proc = subprocess.run(
            cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    entry.update(
        seconds=round(time.monotonic() - t0, 1), load_after=_load(), returncode=proc.returncode
    )
    lines = proc.stdout.strip().splitlines()
    try:
        entry["result"] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        entry["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return entry


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def rows(entry: dict) -> list[tuple[str, str, str]]:
    """(what, figures, ratio) lines of one bench's result for the markdown table."""
    r, name = entry.get("result"), entry["name"]
    if r is None:
        return [(name, f"failed: {entry.get('error')}", "")]
    if name == "roofline":
        f, m = r["roofline"], r.get("model", {})
        ceilings = (f"copy {f['copy_gbps']} GB/s · matvec {f['matvec_gbps']} GB/s · "
                    f"matmul {f['matmul_gflops']} GFLOP/s")  # fmt: skip
        limits = (f"batch-1 bandwidth {m.get('bandwidth_limit_tps')} tok/s · "
                  f"compute {m.get('compute_limit_tps')} tok/s")  # fmt: skip
        return [("ceilings (fp32)", ceilings, ""), ("model limits (fp32)", limits, "")]
    if r.get("bench") == "latency":
        figs = " · ".join(f"{k} {e['decode_tps']} tok/s (p50 {e['decode_step_ms']['p50']} ms, "
                          f"p99 {e['decode_step_ms']['p99']} ms, {e['decode_gbps']} GB/s)"
                          for k, e in r["engines"].items())  # fmt: skip
        ratio = ", ".join(f"vs {k} {v}×" for k, v in r["ratio_inferd_vs"].items())
        return [(f"batch-{r['batch_size']} decode, -q {r['quantization']}", figs,
                 f"{r['inferd_pct_of_bandwidth_limit']}% of bw limit; {ratio}")]  # fmt: skip
    if name == "throughput":
        figs = " · ".join(
            f"{k} {e['single_decode_tps']:.1f} / {e['batch_tps']:.1f}"
            for k, e in r["engines"].items()
        )
        ratio = ", ".join(
            f"vs {k} {r['ratio_single_decode'][k]}× / {v}×" for k, v in r["ratio_batch"].items()
        )
        return [(f"1-stream / {r['num_prompts']}-request tok/s", figs, ratio)]
    if name == "multi-turn":
        figs = " · ".join(
            f"{k} TTFT {e['mean_ttft_s']:.3f} s, e2e {e['e2e_s']:.2f} s"
            for k, e in r["engines"].items()
        )
        return [(f"{r['turns']}-turn chat", figs, "peer / inferd e2e: " + _fmt(r["ratio_e2e"]))]
    if name == "shared-prefix":
        figs = " · ".join(f"{k} TTFT {e['mean_ttft_s']:.2f} s" for k, e in r["engines"].items())
        return [(f"{r['num_requests']} × shared {r['prefix_len']}-token prefix", figs,
                 "peer / inferd TTFT: " + _fmt(r["ratio_mean_ttft"]))]  # fmt: skip
    if name == "long-context":
        out = []
        for p in r["points"]:
            figs = " · ".join(f"{k} prefill {e['prefill_s']} s, {e['decode_tps']} tok/s" +
                              (f", KV {e['kv_mib']} MiB" if e["kv_mib"] is not None else "")
                              for k, e in p["engines"].items())  # fmt: skip
            out.append((f"context {p['context']}", figs, ""))
        out[-1] = (
            *out[-1][:2],
            "decode decay: "
            + _fmt({k: v["decode_decay_pct"] for k, v in r["from_shortest_to_longest"].items()}),
        )
        return out
    if name == "structured":
        return [(f"JSON schema vs free, batch {b}", f"{x['json_schema_tps']} vs {x['free_tps']} tok/s", f"{x['ratio']}×")
                for b, x in r["batches"].items()]  # fmt: skip
    if name == "serve":
        return [(f"server, concurrency {p['concurrency']}",
                 (f"{p['output_tps']:.1f} out tok/s, TTFT p50 {p['ttft_ms']['p50']:.0f} ms, "
                  f"TPOT p50 {p['tpot_ms']['p50']:.1f} ms"), "")
                for p in r["points"]]  # fmt: skip
    return [(name, json.dumps(r)[:200], "")]


def markdown(report: dict) -> str:
    lines = [f"# inferd benchmarks, {report['date']}", "",
             f"{report['machine']}; torch {report['torch']}, {report['threads']} threads"
             + ("; --quick" if report["quick"] else ""), "",
             "| bench | what | figures | ratio | load before → after | command |", "|---|---|---|---|---|---|"]  # fmt: skip
    for e in report["benches"]:
        for what, figs, ratio in rows(e):
            lines.append(f"| {e['name']} | {what} | {figs} | {ratio} | {e['load_before']} → "
                         f"{e['load_after']} | `{e['command']}` |")  # fmt: skip
    notes = sorted({n for e in report["benches"] for n in (e.get("result") or {}).get("notes", [])})
    if notes:
        lines += ["", "Notes:", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="one run each, short lengths (minutes, not an hour)"
    )
    p.add_argument("--only", default=",".join(BENCHES), help=f"comma list of: {', '.join(BENCHES)}")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds per bench")
    p.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: inferd's default model)"
    )
    p.add_argument("--threads", type=int, default=0,
                   help="threads of the roofline / latency / offline benches (0: torch's default)")  # fmt: skip
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - set(BENCHES)
    if unknown:
        p.error(f"unknown bench(es) {sorted(unknown)}; choose from {', '.join(BENCHES)}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quick": args.quick,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "torch": torch.__version__, "threads": args.threads or torch.get_num_threads(), "benches": []}  # fmt: skip
    for name in names:
        try:
            entry = run_bench(name, args.quick, args.timeout, args.model, args.threads)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            entry = {
                "name": name,
                "error": str(e),
                "command": "",
                "load_before": "",
                "load_after": _load(),
            }
        report["benches"].append(entry)
        print(
            f"[{name}] " + ("ok" if "result" in entry else f"failed: {entry['error']}"),
            file=sys.stderr,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stamp}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stamp}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"written: {out / stamp}.json, .md", file=sys.stderr)
    return 0 if all("result" in e for e in report["benches"]) else 1


if __name__ == "__main__":
    sys.exit(main())
