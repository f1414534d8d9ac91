"""``attnchat --screenshot``: the attention panel's Insight tab, each view with real results.

Called by :mod:`desktop.panels.attention.shots` with the panel open (floating, fixed
size), the head atlas measured and its best induction head chosen. Saves, for each
palette ``<p>``: ``panel-attention-insight-explain-<p>.png`` (the newest reply token),
``-knockout-<p>.png`` (the top induction heads knocked out, and the induction test),
``-sandbox-<p>.png`` (the worked example after a wrong guess was revealed),
``-scale-<p>.png`` and ``-cost-<p>.png`` (measured at the conversation's length).
Must not import torch or runtime.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

__all__ = ["shoot_insight"]


def shoot_insight(app, panel, dock, out: Path, written: list[Path], *, themes, settle: Callable, save: Callable,
                  themed: Callable, timeout_s: float = 600) -> None:
    """Run each Insight view on the open conversation and save it (see the module docstring)."""
    ins = panel.insight
    tabs = ins.tabs
    panel.tabs.setCurrentWidget(tabs)  # the panel's Insight tab; this package does not import the panel

    def until(done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Insight tab showed no {what} within {timeout_s:.0f} s")
            settle(app, 50)

    def shot(view, name: str) -> None:
        tabs.setCurrentWidget(view)
        settle(app)
        for theme in themes:
            themed(app, theme)
            save(dock, out / f"panel-attention-insight-{name}-{theme}.png", written)

    tabs.setCurrentWidget(tabs.explain)
    ins.explain()
    until(lambda: tabs.explain.result is not None and not ins.busy("explain"), "explanation")
    shot(tabs.explain, "explain")

    tabs.setCurrentWidget(tabs.knockout)
    ins.fill_induction_heads()
    tabs.knockout.mode.setCurrentIndex(tabs.knockout.mode.findData("mean"))
    ins.knockout()
    until(lambda: tabs.knockout.result is not None and not ins.busy("knockout"), "knock-out")
    ins.induction()
    until(lambda: tabs.knockout.preset is not None and not ins.busy("induction"), "induction test")
    shot(tabs.knockout, "knockout")

    sb = tabs.sandbox
    sb.load_example()
    sb.hide.setChecked(True)
    sb.guess.setCurrentIndex(2)
    sb.do_reveal()
    shot(sb, "sandbox")
    shot(tabs.scale, "scale")

    tabs.setCurrentWidget(tabs.cost)
    ins.cost()
    until(lambda: tabs.cost.timing is not None and not ins.busy("cost"), "timing")
    shot(tabs.cost, "cost")
