"""DELTASERVE_LOG_COMPILES=1: one log line per Triton JIT compile, to find the kernels that
compile while serving (a first-use stall of a new shape or specialisation).

Triton compiles a kernel once per specialisation: besides its constexprs and the argument
dtypes, an int argument equal to 1 becomes a constant, and an int divisible by 16 (or a pointer
aligned to 16 bytes) is marked so, so a token or row count that turns 1 or a multiple of 16, or
stops being one, compiles the kernel again. Each line names the kernel, its constexprs and
launch options, every runtime argument with its type (`/16`: divisible by 16, or a 16-byte
aligned pointer; `=1`: the value 1, compiled in) and the compile time (from Triton's on-disk
cache when it is a few milliseconds).

Triton's JIT hooks (`triton.knobs.runtime.jit_cache_hook`, called before a compile, and
`jit_post_compile_hook`, after it; `JITFunction.cache_hook` / `compiled_hook` in older Triton)
see every compile, an autotuner's candidates included. Hooks installed by others stay in place
and are called first. The interpreter (TRITON_INTERPRET=1) compiles nothing.
"""

from __future__ import annotations

import time
from typing import Any

from deltaserve import env
from deltaserve.logger import get_logger

logger = get_logger(__name__)

_started: dict[tuple[int, str], float] = {}  # (kernel, specialisation key) -> start time


def install_compile_log() -> bool:
    """With DELTASERVE_LOG_COMPILES set, install the hooks that log every Triton compile from
    now on (idempotent); True when they are installed."""
    if not env.log_compiles():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("DELTASERVE_LOG_COMPILES: Triton is not installed, nothing to log")
        return False
    host, pre_name, post_name = _hook_slots()
    if host is None:
        logger.warning("DELTASERVE_LOG_COMPILES: this Triton has no JIT compile hooks")
        return False
    post = getattr(host, post_name)
    if getattr(post, "deltaserve_compile_log", False):
        return True
    setattr(host, pre_name, _chain_pre(getattr(host, pre_name)))
    setattr(host, post_name, _chain_post(post))
    logger.info("DELTASERVE_LOG_COMPILES: logging every Triton JIT compile")
    return True


def _hook_slots() -> tuple[Any, str, str]:
    """(object, before-compile attribute, after-compile attribute) of this Triton's hooks."""
    try:
        from triton import knobs

        if hasattr(knobs.runtime, "jit_post_compile_hook"):
            return knobs.runtime, "jit_cache_hook", "jit_post_compile_hook"
    except ImportError:
        pass
    from triton.runtime.jit import JITFunction

    if hasattr(JITFunction, "compiled_hook"):
        return JITFunction, "cache_hook", "compiled_hook"
    return None, "", ""


def _chain_pre(previous):  # noqa: ANN001, ANN202
    def pre(**kwargs: Any) -> Any:
        # NOTE: a true result tells Triton to skip the compile: only a previous hook decides
        skip = previous(**kwargs) if previous is not None else None
        if not skip:
            _started[_key(kwargs)] = time.perf_counter()
        return skip

    return pre


def _chain_post(previous):  # noqa: ANN001, ANN202
    def post(**kwargs: Any) -> Any:
        result = previous(**kwargs) if previous is not None else None
        start = _started.pop(_key(kwargs), None)
        took = "" if start is None else f" in {1e3 * (time.perf_counter() - start):.0f} ms"
        try:
            what = describe_compile(kwargs["fn"], kwargs["compile"])
        except Exception as e:  # a Triton whose hook arguments differ: still one line
            what = f"{kwargs.get('repr', '?')} ({type(e).__name__} reading its arguments)"
        logger.info("triton compile: %s%s", what, took)
        return result

    post.deltaserve_compile_log = True  # type: ignore[attr-defined]
    return post


def _key(kwargs: dict) -> tuple[int, str]:
    fn = kwargs.get("fn")
    return id(getattr(fn, "jit_function", fn)), str(kwargs.get("key"))


def describe_compile(fn: Any, compile: dict) -> str:
    """`module.kernel[CONSTEXPR=value, ..., num_warps=.., num_stages=..](arg:type/16, n=1,
    ...)` from the arguments Triton passes its JIT hooks (`fn`: JitFunctionInfo, `compile`:
    signature {name: type}, constants {(index,): value}, configs [{(index,): attributes}])."""
    jit = getattr(fn, "jit_function", None)
    declared = {p.name for p in getattr(jit, "params", ()) if p.is_constexpr}
    constants = compile.get("constants") or {}
    configs = compile.get("configs") or [{}]
    aligned = {
        path
        for path, attrs in (configs[0] or {}).items()
        if any(a and a[0] == "tt.divisibility" for a in attrs)
    }
    meta, args = [], []
    for i, (name, ty) in enumerate(compile["signature"].items()):
        if name in declared:
            meta.append(f"{name}={_value(constants.get((i,)))}")
        elif ty == "constexpr":  # an int specialised to its value (1), or None
            args.append(f"{name}={_value(constants.get((i,)))}")
        else:
            args.append(f"{name}:{ty}{'/16' if (i,) in aligned else ''}")
    meta += [f"num_warps={compile.get('num_warps')}", f"num_stages={compile.get('num_stages')}"]
    return f"{fn.module}.{fn.name}[{', '.join(meta)}]({', '.join(args)})"


def _value(v: Any) -> Any:
    return getattr(v, "value", v)  # a tl.constexpr's value; dtypes print as their names
