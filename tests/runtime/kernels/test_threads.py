"""The thread governor (runtime.kernels.threads): fake clocks play a quiet and a busy machine."""
from __future__ import annotations

import pytest

from runtime.kernels.threads import ThreadGovernor, thread_options


class FakeMachine:
    """A step costs ``cost[threads]`` seconds (changeable mid-run)."""

    def __init__(self, cost: dict[int, float]):
        self.cost, self.now, self.threads, self.ran = dict(cost), 0.0, max(cost), []

    def set(self, k):
        self.threads = k

    def step(self):
        self.ran.append(self.threads)
        self.now += self.cost[self.threads]


def _governor(m: FakeMachine, **kw) -> ThreadGovernor:
    return ThreadGovernor(tuple(sorted(m.cost, reverse=True)), m.set, lambda: m.threads, clock=lambda: m.now, **kw)


def _run(gov, m, n):
    for _ in range(n):
        gov.run(m.step)


def test_options_per_machine_size():
    assert thread_options(1) == (1,)
    assert thread_options(2) == (2, 1)
    assert thread_options(4) == (4, 3, 2, 1)
    assert thread_options(16) == (16, 15, 8)
    with pytest.raises(ValueError):
        thread_options(0)


def test_a_quiet_machine_keeps_every_thread_and_probes_rarely():
    # 2-core AMD EPYC Zen 3, quiet: ~38 ms on 2 threads, ~56 ms on 1
    m = FakeMachine({2: 0.038, 1: 0.056})
    gov = _governor(m)
    _run(gov, m, 1000)
    assert gov.choice == 2
    one = m.ran.count(1)
    assert 10 <= one <= 70  # calibration, then a try when 50x its 18 ms extra cost has passed
    assert m.now < 1000 * 0.038 * 1.03  # under 3 % lost to trying


def test_a_busy_core_moves_to_fewer_threads_within_a_few_steps_and_stays():
    # the same machine with another busy program: 2 threads collapse (measured 1.2 s)
    m = FakeMachine({2: 1.2, 1: 0.058})
    gov = _governor(m)
    _run(gov, m, 3)
    assert gov.choice == 1 and m.ran[:2] == [2, 1]
    _run(gov, m, 997)
    assert m.ran.count(2) == 2  # the first step, then one try after 50 x 1.14 s
    assert m.now < 1000 * 0.058 * 1.05 + 1.2


def test_it_follows_the_machine_when_the_load_comes_and_goes():
    m = FakeMachine({2: 0.038, 1: 0.056})
    gov = _governor(m)
    _run(gov, m, 300)
    assert gov.choice == 2
    m.cost = {2: 1.2, 1: 0.058}  # another program starts: the next slow step looks around
    _run(gov, m, 3)
    assert gov.choice == 1
    m.cost = {2: 0.038, 1: 0.056}  # and stops: found again at the next try, within ~57 s
    _run(gov, m, 1300)  # 73 s
    assert gov.choice == 2 and m.ran[-100:].count(2) > 90


def test_run_times_per_unit_and_sets_the_count_only_when_it_changes():
    m = FakeMachine({2: 0.5, 1: 1.0})
    sets = []
    gov = ThreadGovernor((2, 1), lambda k: (sets.append(k), m.set(k)), lambda: m.threads, clock=lambda: m.now)
    assert gov.run(lambda: m.step() or "out", units=100) == "out"
    assert gov.median(2) == pytest.approx(0.005)  # seconds per token of a 100-token chunk
    assert sets == []  # already on 2
    gov.run(m.step, units=100)  # the calibration step on 1 thread
    assert sets == [1] and gov.median(1) == pytest.approx(0.01)
    assert gov.describe() == {"threads": 2, "median_ms": {2: 5.0, 1: 10.0}}


def test_a_fixed_count_never_changes():
    m = FakeMachine({1: 0.05})
    gov = _governor(m)
    _run(gov, m, 50)
    assert set(m.ran) == {1}


def test_each_size_class_has_its_own_governor():
    from runtime.kernels.threads import SizedGovernors

    # short chunks: 1 thread as fast; long ones: 2 threads twice as fast (quiet 2-core machine)
    m = FakeMachine({2: 0.0, 1: 0.0})
    govs = SizedGovernors(lambda: _governor(m))

    def chunk(n):
        per_token = {2: 0.002, 1: 0.0019} if n < 64 else {2: 0.002, 1: 0.0036}
        m.cost = {k: v * n for k, v in per_token.items()}
        return govs.run(m.step, size=n)

    for _ in range(6):
        chunk(16)
        chunk(512)
    assert govs.governor(16).choice == 1 and govs.governor(20).choice == 1
    assert govs.governor(512).choice == 2 and govs.governor(600).choice == 2
    assert set(govs.describe()) == {"16-31", "512-1023"}


def test_a_new_size_class_starts_on_the_hinted_count():
    from runtime.kernels.threads import SizedGovernors

    m = FakeMachine({2: 1.2, 1: 0.06})  # a busy core: 2 threads are slow for every size
    decode = _governor(m)
    for _ in range(3):
        decode.run(m.step)
    assert decode.choice == 1
    govs = SizedGovernors(lambda: _governor(m), start=lambda: decode.choice)
    m.ran.clear()
    for _ in range(3):  # a new class: its first chunk runs on 1 thread, then tries 2 once
        govs.run(m.step, size=500)
    assert m.ran == [1, 2, 1] and govs.governor(500).choice == 1
    assert SizedGovernors(lambda: _governor(m)).governor(20).choice == 2  # no hint: the most


class ColdStart(FakeMachine):
    """The first calls are slow whatever the count: the first builds the token's graph, the
    next few find the weights out of the CPU's caches (measured: default model, Intel Xeon,
    2 cores: 21.5 ms on 2 threads, then 16.7, 14.5, 11.3 on 1; warm 6 on 2, 10 on 1)."""

    extra = [0.0155, 0.0067, 0.0045, 0.0013]

    def step(self):
        super().step()
        if len(self.ran) <= len(self.extra):
            self.now += self.extra[len(self.ran) - 1]


def test_a_cold_first_call_does_not_keep_a_quiet_machine_on_fewer_threads():
    m = ColdStart({2: 0.006, 1: 0.010})
    gov = _governor(m)
    _run(gov, m, 2)
    assert m.ran == [2, 1] and gov.choice == 1   # cold: 21.5 ms on 2 against 16.7 on 1
    _run(gov, m, 98)
    assert gov.choice == 2
    assert m.ran[:6] == [2, 1, 1, 1, 1, 2]   # looked at again three calls later, once
    assert m.ran[6:40].count(1) == 0


def test_a_clear_choice_of_fewer_threads_is_not_looked_at_again():
    """A busy core (2 threads 20x slower) after the same cold start: 2 threads are not tried
    again before the budget allows."""
    m = ColdStart({2: 0.2, 1: 0.010})
    gov = _governor(m)
    _run(gov, m, 60)
    assert gov.choice == 1 and m.ran.count(2) == 1
