"""Compile a Triton kernel for sm_90 on a machine without a GPU (Triton's NVIDIA backend and its
bundled ptxas), with the JIT's usual specialisation (16-byte aligned pointers, the named ints
divisible by 16), so CPU tests catch what the interpreter lets through (type and shape errors
of untaken branches) and read what the compiler made of a kernel (registers, spills, async
copies).

Triton's interpreter mode (TRITON_INTERPRET=1, set for CPU test runs) replaces `triton.jit`, so
the compiles run in a subprocess without it: `compile_many` sends the jobs as JSON to this
file's `__main__` and reads the results back."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field


def ptxas_path() -> str | None:
    """Triton's bundled ptxas, or None where this Triton has no NVIDIA backend."""
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.access(path, os.X_OK) else None


# The head of a script that runs Triton's real JIT in a subprocess against a stand-in driver
# reporting an sm_90 target: `kernel.warmup(...)` then compiles (bundled ptxas) without a launch.
STAND_IN_DRIVER = """
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class StandIn:  # what the JIT asks of a driver before it compiles (no launch in warmup)
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


driver.set_active(StandIn())
"""


@dataclass
class Compiled:
    registers: int
    spill_bytes: int
    async_copies: int  # async copy ops in the TTGIR: loads Triton pipelines through smem
    has_atomics: bool
    # global memory instructions in the PTX by kind, e.g. {"ld.global.cg.v4.b32": 8}
    memory_ops: dict[str, int]
    # programmatic dependent launch (deltaserve.ops.pdl): griddepcontrol.wait in the PTX, and
    # the global loads / stores that come before the first one in the PTX text
    pdl_wait: bool = False
    loads_before_wait: int = 0
    stores_before_wait: int = 0
    # each tt.reduce's operand in the TTGIR: [shape, layout] (its #alias resolved), e.g.
    # ["1x4096xf32", "#ttg.blocked<{sizePerThread = [1, 8], ...}>"]; the layout fixes the
    # order in which the reduction adds its elements
    reduce_operands: list = field(default_factory=list)
    shared_bytes: int = 0  # the shared memory a program takes (Triton's compile metadata)


def compile_sm90(
    kernel,
    signature: dict,
    constexprs: dict,
    div16: list[str],
    num_warps=4,
    num_stages=4,
    maxnreg: int | None = None,
    capability: int = 90,
) -> Compiled:
    """Compile `kernel` (a JIT function, or an autotuner / heuristics wrapper of one) for
    sm_90 (or another `capability`, e.g. 86, for its shared memory: the PTX is still assembled
    for sm_90a) and assemble it with ptxas -v (`maxnreg`: Triton's cap on registers a
    thread)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = kernel
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    c = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
    return dataclasses.replace(
        inspect_sm90(c.asm["ptx"], c.asm["ttgir"]), shared_bytes=c.metadata.shared
    )


def inspect_sm90(ptx: str, ttgir: str) -> Compiled:
    """What ptxas -v (sm_90a) and the text say of a kernel compiled for sm_90 (its PTX and
    TTGIR, e.g. from `kernel.warmup(...)` under the stand-in driver)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        log = subprocess.run(
            [ptxas_path(), "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    ops: dict[str, int] = {}
    for op in re.findall(r"\b(?:ld|st|atom)\.[a-z0-9.]+", ptx):
        if ".global" in op:
            ops[op] = ops.get(op, 0) + 1
    head = ptx.split("griddepcontrol.wait")[0]
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    reduces = re.findall(r"\}\) : \(tensor<([0-9x]+x\w+), (#\w+)>\)", ttgir)
    return Compiled(
        regs,
        spill,
        ttgir.count("async_copy"),
        "atom." in ptx,
        ops,
        "griddepcontrol.wait" in ptx,
        len(re.findall(r"\bld\.global", head)) + head.count("cp.async"),
        len(re.findall(r"\b(?:st|atom|red)\.global", head)),
        [[shape, aliases.get(layout, layout)] for shape, layout in reduces],
    )


def compile_many(jobs: list[dict]) -> list[dict]:
    """Each job {"kernel": "module:name", "signature", "constexprs", "div16", "num_warps",
    "num_stages"} (and optionally "maxnreg", "capability") compiled in one subprocess without
    the interpreter -> Compiled as dicts, or {"error": message}."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def _main() -> None:
    results = []
    for job in json.loads(sys.stdin.read()):
        module, name = job.pop("kernel").split(":")
        kernel = getattr(importlib.import_module(module), name)
        try:
            results.append(asdict(compile_sm90(kernel, **job)))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.append({"error": f"{type(e).__name__}: {e}"})
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
