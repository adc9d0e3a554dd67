"""What a saved benchmark result carries so that it can be reproduced (`bench throughput`,
`bench kernels`: their --json)."""

from __future__ import annotations

import subprocess
import sys
import time


def provenance() -> dict:
    """What a saved result needs to be reproduced: the checkout's commit (with "-dirty" when it
    has uncommitted changes; None outside a git checkout; DELTASERVE_COMMIT, where set, instead:
    a copy of a working tree may carry stale git metadata, as the lent GPU machines' do), the
    command line, the UTC time and every DELTASERVE_* variable set."""
    import os
    from pathlib import Path

    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("DELTASERVE_")}
    root = Path(__file__).resolve().parents[2]
    try:

        def git(*argv: str) -> str:
            run = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True)
            return run.stdout.strip() if run.returncode == 0 else ""

        commit = git("rev-parse", "--short", "HEAD") or None
        if commit and git("status", "--porcelain", "--untracked-files=no"):
            commit += "-dirty"
    except OSError:  # no git
        commit = None
    return {
        "commit": env.pop("DELTASERVE_COMMIT", None) or commit,
        "command": "deltaserve " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "env": env,
    }
