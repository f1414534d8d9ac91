"""The bench's quiet-machine rule (attnchat.bench.quiet)."""
from attnchat.bench import quiet


def test_a_run_above_the_quiet_load_is_noisy():
    assert quiet.mark({}, 0.3, 1.2)["noisy"] is False
    assert quiet.mark({}, 1.6, 0.2)["noisy"] is True
    assert quiet.mark({}, 0.2, 1.51)["noisy"] is True
    assert quiet.mark({}, None, None)["noisy"] is None
    run = quiet.mark({"engine": "ours"}, 0.12, 1.7)
    assert run == {"engine": "ours", "load_before": 0.12, "load_after": 1.7, "noisy": True}
    assert quiet.describe(run) == "load 0.12 -> 1.70, noisy"
    assert quiet.describe(quiet.mark({}, 0.5, None)) == "load 0.50 -> ?"


def test_the_load_average_is_read():
    value = quiet.load_average()
    assert isinstance(value, float) and value >= 0.0
