"""What the tests share about child processes: where the repository is, and how long a child
may take before a test calls it hung.

A test's timeout on a child process is a hang detector, never a speed check (speed lives in
``attnchat bench``): on 2 cores shared with other work (load 3-9) a bench child that takes
40 s on a quiet machine took over 300 s, and a timeout sized to the quiet machine failed CI
for a reason that was not the code's. So every child gets the same generous bound.
"""
from __future__ import annotations

from pathlib import Path

#: The repository's root (children run with it as their working folder or on ``sys.path``).
ROOT = Path(__file__).resolve().parents[1]

#: Seconds a child process may run before the test fails as hung: 20 minutes, well past the
#: slowest child seen on a busy 2-core machine, and inside CI's 90 minutes for the suite.
HANG_S = 1200
