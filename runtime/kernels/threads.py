"""How many CPU threads a prefill chunk or a decode step uses, chosen by timing them as they run.

Must not import Qt. Nothing runs at import time.

Why: torch splits each operation of a step over its OpenMP threads, one per core by
default, and every operation waits for its slowest thread. When another program keeps
one core busy, that thread runs only in the scheduler's time slices and every one of a
step's ~700 parallel regions waits for it. Measured on a 2-core AMD EPYC Zen 3 with one
other busy process, default model (float16 weights), 1,000 tokens of context: a decode
step took 1,184-1,860 ms on 2 threads and 56-61 ms on 1 (a 20-30x collapse); a
256-token prefill chunk 1.7-2.2 s against 0.85 s. On the same machine, quiet, 2 threads
are faster (oneDNN's float32 GEMV read 17 GB/s on 2 threads). Neither count is right
for every moment on a desktop, so :class:`ThreadGovernor` times each step under the
count it ran with and keeps the fastest, trying the others now and then (at once when a
step turns slow, otherwise within a small time budget).
"""
from __future__ import annotations

import functools
import statistics
import time
from collections import deque
from typing import Callable, TypeVar

T = TypeVar("T")


@functools.cache
def max_threads() -> int:
    """torch's intra-op thread count as first read in this process (one per core by
    default, or ``OMP_NUM_THREADS``): what the governors start from and what kernel
    choices and compiled code are keyed by, whatever count a governor set since."""
    import torch

    return torch.get_num_threads()


class SizedGovernors:
    """One :class:`ThreadGovernor` per size class of the work (``size.bit_length()``: 1, 2-3,
    4-7, ... tokens), made on first use by ``make``.

    Prefill chunks need this: the best count depends on the chunk's size. On the quiet
    2-core AMD EPYC Zen 3, 16-token prefills ran as fast on 1 thread as on 2 (3.9 against
    4.2 ms per token) while a 512-token prefill took 1.8 s on 1 against 1.0 s on 2; one
    governor for every size chose 1 thread from the short ones and slowed the long ones.

    Args:
        make: a new governor.
        start: the count a new class starts on (None: the most); the decode governor's
            choice is a good one: decode and long prefills both prefer every core on a quiet
            machine and fewer on a busy one, while short prefills run alike on either and
            say little.
    """

    def __init__(self, make: Callable[[], ThreadGovernor], start: Callable[[], int | None] | None = None):
        self._make, self._start = make, start
        self.by_class: dict[int, ThreadGovernor] = {}

    def governor(self, size: int) -> ThreadGovernor:
        """The governor of ``size``'s class."""
        c = max(int(size), 1).bit_length()
        if c not in self.by_class:
            gov = self._make()
            start = self._start() if self._start is not None else None
            if start in gov.options:
                gov.choice = start
            self.by_class[c] = gov
        return self.by_class[c]

    def run(self, fn: Callable[[], T], size: int) -> T:
        """``fn()`` (``size`` units of work) under its size class's governor."""
        return self.governor(size).run(fn, units=size)

    def describe(self) -> dict:
        """JSON-ready: per size class (``"256-511"``), its governor's :meth:`ThreadGovernor.describe`."""
        return {f"{1 << (c - 1)}-{(1 << c) - 1}": g.describe() for c, g in sorted(self.by_class.items())}


def cpu_governor(threads: int | None = None) -> ThreadGovernor:
    """A governor over torch's thread count: chosen among :func:`thread_options` of
    :func:`max_threads`, or fixed at ``threads``."""
    import torch

    options = (threads,) if threads else thread_options(max_threads())
    return ThreadGovernor(options, torch.set_num_threads, torch.get_num_threads)


def thread_options(max_threads: int) -> tuple[int, ...]:
    """The thread counts worth trying on ``max_threads`` cores, most first: all of them, one
    fewer (leaves a busy core to the other program), half, and one on small machines.

    Raises:
        ValueError: ``max_threads`` below 1.
    """
    if max_threads < 1:
        raise ValueError(f"max_threads must be at least 1, not {max_threads}")
    options = {max_threads, max(1, max_threads - 1), max(1, max_threads // 2)}
    if max_threads <= 4:
        options.add(1)
    return tuple(sorted(options, reverse=True))


class ThreadGovernor:
    """Picks a thread count per call from the times of earlier calls (one phase of work:
    decode steps, or prefill chunks).

    The policy, with ``window`` recent times kept per count (seconds per unit of work,
    e.g. per token):

    - Start on the most threads. After the first call, try each other count once.
    - Then run the count whose recent median is lowest.
    - Now and then try another count for one call, so that a machine that got quieter
      (or busier) is noticed: at most one try per ``min_calls`` calls, and only once
      the wall time since the last try is ``budget`` times what the try is expected to
      cost (its last median minus the current one). Trying 1 thread on a quiet 2-core
      machine costs ~18 ms: about every 0.9 s; trying 2 threads while another program
      holds a core costs ~1.1 s: about once a minute. Either way under 1/``budget``
      of the time.
    - A call slower than ``jump`` times the current count's median (another program just
      started) forgets that count's older times and tries the other counts next.
    - When such a look around (the first calibration, or one after a jump) chose fewer than
      the most threads by less than ``sure`` times, it is looked at again ``confirm`` calls
      later, once. Why: it was taken while the machine was cold. After a load the first
      decode call also built the token's graph, and the first calls after a prefill find the
      weights out of the CPU's caches. On the quiet 2-core Intel Xeon, default model, the
      first call took 21.5 ms on 2 threads and the next 16.7 on 1, and then 1 thread ran
      ~60 calls at 10 ms against 6 ms on 2, until the budget allowed a try. A busy core is
      no such coin toss (2 threads 20x slower): it is not looked at again.

    Args:
        options: thread counts (:func:`thread_options`), most first.
        apply: sets the thread count for the next call (``torch.set_num_threads``).
        current: reads it (``torch.get_num_threads``).
        clock: seconds (``time.perf_counter``; a test passes a fake).
    """

    def __init__(
        self,
        options: tuple[int, ...],
        apply: Callable[[int], None],
        current: Callable[[], int],
        *,
        clock: Callable[[], float] = time.perf_counter,
        window: int = 5,
        min_calls: int = 16,
        budget: float = 50.0,
        jump: float = 3.0,
        sure: float = 2.0,
        confirm: int = 3,
    ):
        if not options:
            raise ValueError("no thread counts to choose from")
        self.options = tuple(options)
        self._apply, self._current, self._clock = apply, current, clock
        self._times = {k: deque(maxlen=window) for k in self.options}
        self.choice = self.options[0]
        self._min_calls, self._budget, self._jump = min_calls, budget, jump
        self._sure, self._confirm = sure, confirm
        self._pending: list[int] = []  # counts to try next, one call each
        self._looking = False   # the pending tries are a look around (calibration or a jump)
        self._confirm_in: int | None = None   # calls on the choice until a look again
        self._since_try = 0
        self._tried_at: float | None = None
        self._next_other = 0
        self.calls = 0

    def median(self, threads: int) -> float | None:
        """Recent median seconds per unit of work on ``threads`` (None: no time yet)."""
        t = self._times[threads]
        return statistics.median(t) if t else None

    def next_threads(self) -> int:
        """The thread count the next call runs with."""
        if self._pending:
            return self._pending[0]
        return self.choice

    def record(self, threads: int, seconds_per_unit: float, now: float | None = None) -> None:
        """Note a call's time on ``threads`` (ended at clock time ``now``) and decide the next count."""
        now = self._clock() if now is None else now
        self.calls += 1
        before = self.median(threads)
        self._times[threads].append(seconds_per_unit)
        if self._pending and self._pending[0] == threads:
            # A try measures the machine as it is now: it replaces the count's older times.
            self._times[threads].clear()
            self._times[threads].append(seconds_per_unit)
            self._pending.pop(0)
            if not self._pending:
                self._decide(now)
            return
        if threads != self.choice:
            return
        others = [k for k in self.options if k != self.choice]
        if not others:
            return
        if self._tried_at is None:  # calibrate: each other count once
            self._pending, self._looking = others, True
            return
        self._since_try += 1
        if self._confirm_in is not None:
            self._confirm_in -= 1
            if self._confirm_in <= 0:   # a close choice of fewer threads made cold: once more, now
                self._confirm_in = None
                self._pending = others
                return
        if before is not None and seconds_per_unit > self._jump * before:
            # The machine changed: forget the count's older times and look around now.
            self._times[threads].clear()
            self._times[threads].append(seconds_per_unit)
            self._pending, self._looking = others, True
        elif self._since_try >= self._min_calls:
            k = others[self._next_other % len(others)]
            last, mine = self.median(k), self.median(self.choice)
            cost = 0.0 if last is None or mine is None else max(last - mine, 0.0)
            if now - self._tried_at >= self._budget * cost:
                self._pending = [k]
                self._next_other += 1

    def _decide(self, now: float) -> None:
        medians = {k: self.median(k) for k in self.options if self._times[k]}
        self.choice = min(medians, key=medians.get)
        self._since_try = 0
        self._tried_at = now
        rest = [m for k, m in medians.items() if k != self.choice]
        if self._looking and self.choice != self.options[0] and rest and min(rest) < self._sure * medians[self.choice]:
            self._confirm_in = self._confirm
        self._looking = False

    def run(self, fn: Callable[[], T], units: float = 1.0) -> T:
        """``fn()`` on the chosen thread count, timed (``units`` of work, e.g. tokens)."""
        k = self.next_threads()
        if self._current() != k:
            self._apply(k)
        t0 = self._clock()
        out = fn()
        t1 = self._clock()
        self.record(k, (t1 - t0) / max(units, 1e-9), now=t1)
        return out

    def describe(self) -> dict:
        """JSON-ready: the choice and each count's recent median (ms per unit)."""
        return {"threads": self.choice, "median_ms": {
            k: round(m * 1e3, 2) for k in self.options if (m := self.median(k)) is not None}}
