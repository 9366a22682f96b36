"""Throughput of each packed weight format's matmul kernel, side by side, at decode and prefill rows.

    python -m inferd.quantization.kernel_bench [--n 2048] [--k 2048] [--rows 1,128] [--mib 256]

Every format holds an [N, K] weight (GGUF types as random blocks, int4 / int8 as Q4_1 / Q8_0
blocks of a random weight, fp32 as a random weight), and each is timed as the engine runs it:
packed tiles with int8 activations where the CPU has AVX512-VNNI (`-q auto`'s default), else the
row layout with fp32 activations (`--avx2` runs the AVX2-only build here); fp32 through `Linear`. Enough copies of each weight are cycled
that the calls stream `--mib` of weights from memory, as a decode step does, instead of reading
one from cache. Prints weight GB/s per format and rows, ratios to fp32 and to int4 (Q4_1), and
ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from inferd.kernels.build import cpu_flags
from inferd.layers.linear import Linear
from inferd.quantization import formats, gguf_blocks
from inferd.quantization.formats import QuantizedWeight, bytes_of, from_gguf_blocks

GGUF_TYPES = ("Q8_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
NAMES = {"Q8_0": "int8 (Q8_0)", "Q4_1": "int4 (Q4_1)"}


def _weight(qtype: str, n: int, k: int, rng: np.random.Generator) -> QuantizedWeight:
    import gguf

    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    if qtype in gguf_blocks.TYPES:  # gguf cannot quantize K-quants: random blocks do as well here
        t = gguf_blocks.TYPES[qtype]
        raw = rng.integers(0, 256, size=(n, k // t.group, t.gguf_bytes), dtype=np.uint8)
        halves = {"Q6_K": (208,), "Q5_0": (0,)}.get(qtype, (0, 2))
        for at in halves:
            d = (rng.standard_normal((n, k // t.group)) * 0.002).astype(np.float16)
            raw[..., at : at + 2] = d.view(np.uint8).reshape(n, k // t.group, 2)
        return from_gguf_blocks(raw.reshape(n, -1), qtype, (n, k))
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return from_gguf_blocks(raw, qtype, (n, k))


def _layers(qtype: str, n: int, k: int, copies: int, rng) -> list[torch.nn.Module]:
    from inferd.layers.quantized_linear import QuantizedLinear

    first = _weight(qtype, n, k, rng)
    out = []
    for _ in range(copies):
        w = QuantizedWeight(first.format, first.data.clone(), first.scales.clone(),
                            None if first.mins is None else first.mins.clone(), first.shape,
                            first.group, first.source)  # fmt: skip
        out.append(QuantizedLinear(formats.pack_tiles(w) or w))
    return out


def _fp32_layers(n: int, k: int, copies: int) -> list[torch.nn.Module]:
    layers = []
    for _ in range(copies):
        lin = Linear(k, n, bias=False)
        torch.nn.init.normal_(lin.weight, std=0.02)
        layers.append(lin)
    return layers


def _seconds_per_call(layers, x: torch.Tensor) -> float:
    """Mean time of one call over one pass through `layers` (their weights stream from memory)."""
    start = time.perf_counter()
    for layer in layers:
        layer(x)
    return (time.perf_counter() - start) / len(layers)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--rows", default="1,128")
    p.add_argument(
        "--mib", type=int, default=256, help="weight bytes each format streams per round"
    )
    p.add_argument(
        "--rounds", type=int, default=5, help="formats alternate; each keeps its best round"
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--types", default=",".join(GGUF_TYPES))
    p.add_argument(
        "--avx2",
        action="store_true",
        help="the AVX2-only build, as a CPU without AVX-512 runs it (no tiles; fp32 activations)",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.avx2:  # every quantized matmul of this process through the AVX2-only kernels
        from inferd.kernels.quant_gemm import extension_avx2

        formats._EXT = extension_avx2() or False
    rng = np.random.default_rng(0)
    rows = [int(r) for r in args.rows.split(",")]
    ext = formats._kernels()
    int8_x = ext is not None and formats.int8_activations_default(ext)
    report = {"n": args.n, "k": args.k, "threads": torch.get_num_threads(), "int8_activations": int8_x,
              "vnni": "avx512_vnni" in cpu_flags().split(), "formats": {}}  # fmt: skip
    print(
        f"[{args.n}, {args.k}] weights, {torch.get_num_threads()} threads, int8 activations: {int8_x}"
    )
    built: dict[str, tuple[list, int]] = {}
    for qtype in ("fp32", *args.types.split(",")):
        if qtype == "fp32":
            copies = max(2, (args.mib << 20) // (4 * args.n * args.k))
            built["fp32"] = (_fp32_layers(args.n, args.k, copies), 4 * args.n * args.k)
        else:
            probe = _weight(qtype, args.n, args.k, rng)
            layers = _layers(
                qtype, args.n, args.k, max(2, (args.mib << 20) // bytes_of(probe)), rng
            )
            built[NAMES.get(qtype, qtype)] = (layers, bytes_of(layers[0].qweight))
    xs = {m: torch.randn(m, args.k) for m in rows}
    best = {(name, m): float("inf") for name in built for m in rows}
    for _ in range(args.rounds):  # alternating: a noisy neighbour slows every format alike
        for name, (layers, _) in built.items():
            for m in rows:
                best[name, m] = min(best[name, m], _seconds_per_call(layers, xs[m]))
    for name, (layers, nbytes) in built.items():
        entry = {"bits_per_weight": round(8 * nbytes / (args.n * args.k), 3)}
        if hasattr(layers[0], "qweight"):
            entry["layout"] = layers[0].qweight.layout
        for m in rows:
            s = best[name, m]
            entry[f"rows{m}"] = {"us": round(s * 1e6, 1), "weight_gbps": round(nbytes / s / 1e9, 2),
                                 "gflops": round(2 * m * args.n * args.k / s / 1e9, 1)}  # fmt: skip
        report["formats"][name] = entry
        cols = "  ".join(f"rows {m}: {entry[f'rows{m}']['us']:8.1f} us {entry[f'rows{m}']['weight_gbps']:6.2f} GB/s"
                         for m in rows)  # fmt: skip
        print(f"{name:<12} {entry['bits_per_weight']:6.3f} b/w  {cols}")
    for base in ("fp32", "int4 (Q4_1)"):
        if base in report["formats"]:
            report[f"speed_vs_{base.split()[0]}"] = {
                f: {f"rows{m}": round(report["formats"][base][f"rows{m}"]["us"] / e[f"rows{m}"]["us"], 2) for m in rows}
                for f, e in report["formats"].items()
            }  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
