"""`pagedllm bench <kind>`: each kind lives in its own module with add_args(parser) and run(args)."""

from __future__ import annotations

import argparse
import importlib

# kind -> (module, help)
BENCHES = {
    "throughput": ("pagedllm.bench.throughput", "offline throughput on a workload (vLLM's bench throughput)"),
    "latency": ("pagedllm.bench.latency", "batch-size-1 latency: ms per output token"),
    "compare": ("pagedllm.bench.compare", "paged vs contiguous KV reservation at the same KV budget"),
    "serve": ("pagedllm.bench.serve", "load an OpenAI-compatible server with Poisson arrivals"),
    "perplexity": ("pagedllm.bench.perplexity", "perplexity of a text file, as llama.cpp's llama-perplexity"),
    "sharing": ("pagedllm.bench.sharing", "KV memory saved by sharing (n > 1, beams); prefix caching speed"),
}


def add_bench_parser(sub: argparse._SubParsersAction, with_kinds: bool = True) -> None:
    """The `bench` command; ``with_kinds`` False leaves out its kinds, whose modules are then not imported."""
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    if not with_kinds:
        return
    for kind, (module_name, help_text) in BENCHES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # not built yet, or its optional dependencies are missing
        p = kinds.add_parser(kind, help=help_text)
        module.add_args(p)
        p.set_defaults(func=module.run)
