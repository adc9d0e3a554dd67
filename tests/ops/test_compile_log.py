"""DELTASERVE_LOG_COMPILES=1 (deltaserve/ops/compile_log.py): one line per Triton JIT compile,
naming the kernel and its specialisation, through the installed Triton's own JIT hooks.

Without a GPU the JIT runs for real in a subprocess (no interpreter) against a stand-in driver
that reports an sm_90 target: `kernel.warmup(...)` compiles without launching, with Triton's
bundled ptxas, as tests/ops/sm90_compile.py does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deltaserve.ops.compile_log import install_compile_log

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm90_compile import STAND_IN_DRIVER, ptxas_path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

SCRIPT = STAND_IN_DRIVER + textwrap.dedent(
    """
    from deltaserve.ops.compile_log import install_compile_log
    calls = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: calls.append(kw["fn"].name)


    @triton.jit
    def scale(x_ptr, n, m, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * m, mask=i < n)


    assert install_compile_log() and install_compile_log()  # idempotent
    x = torch.zeros(64)
    scale.warmup(x, 17, 1, BLOCK=64, grid=(1,))
    scale.warmup(x, 16, 3, BLOCK=64, grid=(1,))
    scale.warmup(x, 16, 5, BLOCK=64, grid=(1,))  # the same specialisation: no compile
    print("previous hook:", calls)
    """
)


def test_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELTASERVE_LOG_COMPILES", raising=False)
    assert install_compile_log() is False


@pytest.mark.skipif(ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas")
def test_one_line_per_compile_with_its_specialisation(tmp_path: Path) -> None:
    script = tmp_path / "compile.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {
        "DELTASERVE_LOG_COMPILES": "1",
        "DELTASERVE_LOG_LEVEL": "INFO",
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "triton compile:" in line]
    assert len(lines) == 2, done.stderr
    name = "__main__.scale[BLOCK=64, num_warps=4, num_stages=3]"
    assert f"{name}(x_ptr:*fp32/16, n:i32, m=1) in " in lines[0]
    assert f"{name}(x_ptr:*fp32/16, n:i32/16, m:i32) in " in lines[1]
    assert lines[0].endswith(" ms")
    assert "previous hook: ['scale', 'scale']" in done.stdout  # chained, not replaced
