"""scripts/gpu_test_parts.txt splits the GPU tests into parts that each fit one device call
(scripts/gpu_tests.sh): every test file with GPU tests is in exactly one part, and every file
it names exists."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _parts() -> dict[str, list[str]]:
    parts = {}
    for line in (ROOT / "scripts" / "gpu_test_parts.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, files = line.split(":", 1)
        parts[name.strip().rstrip("*")] = files.split()
    return parts


def test_every_gpu_test_file_is_in_exactly_one_part() -> None:
    named = [f for files in _parts().values() for f in files]
    assert len(named) == len(set(named)), "a file is in two parts"
    assert all((ROOT / f).is_file() for f in named), "a part names a missing file"
    marker = "pytest.mark." + "gpu"  # spelt apart: this file is not a GPU test file
    with_gpu = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if marker in p.read_text()
    }
    assert with_gpu == set(named)
