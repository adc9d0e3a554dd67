"""Session-wide test setup: nothing engine-specific lives here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def deltaserve_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point DELTASERVE_CACHE_DIR at a fresh temporary directory for the whole session, so tests
    never read or write the user's cache (the demo model is built there once, on first use)."""
    path = tmp_path_factory.mktemp("deltaserve-cache")
    previous = os.environ.get("DELTASERVE_CACHE_DIR")
    os.environ["DELTASERVE_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("DELTASERVE_CACHE_DIR", None)
    else:
        os.environ["DELTASERVE_CACHE_DIR"] = previous
