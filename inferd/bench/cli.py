"""`inferd bench ...` subcommands."""

from __future__ import annotations


def add_bench_parser(sub) -> None:
    from inferd.bench.allreduce import add_allreduce_parser
    from inferd.bench.data_parallel import add_data_parallel_parser
    from inferd.bench.latency import add_latency_parser
    from inferd.bench.offline import add_offline_parser
    from inferd.bench.pd import add_pd_parser
    from inferd.bench.prefix import add_prefix_parser
    from inferd.bench.roofline import add_roofline_parser
    from inferd.bench.router_overhead import add_router_overhead_parser
    from inferd.bench.serve import add_serve_parser
    from inferd.bench.soak import add_soak_parser
    from inferd.bench.spec import add_spec_parser
    from inferd.bench.structured import add_structured_parser
    from inferd.bench.swap import add_swap_parser

    p = sub.add_parser("bench", help="benchmarks, with peers side by side")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    add_offline_parser(bench_sub)
    add_latency_parser(bench_sub)
    add_roofline_parser(bench_sub)
    add_prefix_parser(bench_sub)
    add_structured_parser(bench_sub)
    add_serve_parser(bench_sub)
    add_spec_parser(bench_sub)
    add_soak_parser(bench_sub)
    add_router_overhead_parser(bench_sub)
    add_allreduce_parser(bench_sub)
    add_pd_parser(bench_sub)
    add_swap_parser(bench_sub)
    add_data_parallel_parser(bench_sub)
