"""A saved benchmark result says what produced it: the commit (DELTASERVE_COMMIT where set: the
lent GPU machines' copy of the tree carries stale git metadata), the command, the time and the
DELTASERVE_* variables that were set."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from deltaserve.bench import provenance as prov


def test_provenance_names_the_commit_and_the_variables(monkeypatch) -> None:
    for key in list(os.environ):
        if key.startswith("DELTASERVE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("DELTASERVE_PDL", "0")
    monkeypatch.setenv("DELTASERVE_COMMIT", "abc1234")
    p = prov.provenance()
    assert p["commit"] == "abc1234" and p["env"] == {"DELTASERVE_PDL": "0"}
    assert p["command"].startswith("deltaserve ") and p["date"].endswith("Z")
    monkeypatch.delenv("DELTASERVE_COMMIT")
    root = Path(prov.__file__).resolve().parents[2]
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    )
    commit = prov.provenance()["commit"]
    if head.returncode == 0:  # a git checkout: its HEAD, "-dirty" with uncommitted changes
        assert commit.split("-")[0] == head.stdout.strip()
    else:
        assert commit is None
