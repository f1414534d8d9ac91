"""The kernel tests time, choose and keep kernel choices themselves: the suite's mode of default
kernels (tests/conftest.py) is lifted here; a test that wants the defaults sets them itself."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _kernels_measured(monkeypatch):
    monkeypatch.delenv("ATTNCHAT_KERNELS", raising=False)
