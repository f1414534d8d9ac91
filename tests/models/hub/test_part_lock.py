"""The download part's lock: taken in turns, and no ``.lock`` file left behind."""
from __future__ import annotations

import threading
import time

from models.hub.part_lock import part_lock


def test_turns_are_taken_and_the_lock_file_goes(tmp_path):
    path = tmp_path / "x.part.lock"
    order: list[str] = []
    inside = threading.Event()

    def second():
        inside.wait()
        with part_lock(path):   # opens the first holder's file, then finds it deleted: locks a new one
            order.append("second in")
            assert path.exists()
        order.append("second out")

    t = threading.Thread(target=second)
    with part_lock(path):
        t.start()
        inside.set()
        time.sleep(0.2)   # let the second one open the file and block on it (order is checked, not time)
        order.append("first out")
    t.join(timeout=30)
    assert order == ["first out", "second in", "second out"]
    assert list(tmp_path.iterdir()) == []
