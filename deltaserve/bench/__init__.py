"""`deltaserve bench ...`: serving load, engine throughput and kernel microbenchmarks.

Each sub-command lives in its own module exposing `add_parser(subcommands)`, which registers the
sub-command with a `handler(args) -> int` default. Modules are imported only when `deltaserve
bench` is parsed, and each keeps its heavy imports (torch, the engine) inside its handler.
"""

from __future__ import annotations

import importlib
from typing import Any

# sub-command -> module (each module defines add_parser)
SUBCOMMANDS = {
    "serve": "deltaserve.bench.serve",
    "throughput": "deltaserve.bench.throughput",
    "kernels": "deltaserve.bench.kernels",
    "spec": "deltaserve.bench.spec",
    "vision": "deltaserve.bench.vision",
    "startup": "deltaserve.bench.startup",
}


def add_bench_parser(commands: Any) -> None:
    """Register `deltaserve bench` and its sub-commands on the top-level subparsers."""
    parser = commands.add_parser(
        "bench", help="benchmarks: serve | throughput | kernels | spec | vision | startup"
    )
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for module in SUBCOMMANDS.values():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # a missing dependency inside the module is a real error
                raise
            continue  # sub-command not built yet
        mod.add_parser(sub)
