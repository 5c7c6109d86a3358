"""The queue delay policies of a partial batch, on a fake clock (integer nanoseconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from inference import model_config_pb2 as mc
from shared.batch_delay import GAP_FACTOR, BatchDelay
from shared.config import load_config
from shared.errors import ConfigError
from shared.queue_bounds import batch_policy
from shared.stage import StageConfig

MS = 1_000_000
MAX_US = 5_000  # Triton's max_queue_delay_microseconds of these tests: 5 ms


def arrivals(delay: BatchDelay, start_ns: int, gap_ns: int, count: int, company: bool) -> int:
    """``count`` arrivals ``gap_ns`` apart from ``start_ns``; returns the last one's time."""
    now = start_ns
    for index in range(count):
        now = start_ns + index * gap_ns
        delay.arrived(now, company)
    return now


def test_fixed_waits_the_whole_delay_after_the_oldest_whatever_the_traffic() -> None:
    delay = BatchDelay("fixed", MAX_US)
    arrivals(delay, 0, 10 * MS, 20, company=False)
    assert delay.deadline_ns(oldest_ns=500 * MS) == 505 * MS
    arrivals(delay, 1000 * MS, MS // 10, 20, company=True)
    assert delay.deadline_ns(oldest_ns=1000 * MS) == 1005 * MS


def test_adaptive_sends_a_lone_request_at_once() -> None:
    delay = BatchDelay("adaptive", MAX_US)
    # One request in flight at a time (a closed loop of one client): nobody to wait for,
    # however close together the requests come.
    last = arrivals(delay, 0, 2 * MS, 50, company=False)
    assert delay.deadline_ns(oldest_ns=last) == last
    # Nothing learned yet: the first request of a model's life does not wait either.
    assert BatchDelay("adaptive", MAX_US).deadline_ns(oldest_ns=7) == 7


def test_adaptive_waits_about_two_gaps_after_the_newest_while_requests_overlap() -> None:
    delay = BatchDelay("adaptive", MAX_US)
    last = arrivals(delay, 0, MS, 40, company=True)
    assert delay.gap_ns == pytest.approx(MS)
    # Oldest queued 1 ms before the newest: the batch is held for two more gaps.
    assert delay.deadline_ns(oldest_ns=last - MS) == last + round(GAP_FACTOR * MS)
    # The newest arrival moves the deadline on, but never past the fixed one.
    delay.arrived(last + MS, company=True)
    assert delay.deadline_ns(oldest_ns=last - MS) == last + 3 * MS
    delay.arrived(last + 3 * MS, company=True)
    assert delay.deadline_ns(oldest_ns=last - MS) == last - MS + MAX_US * 1000


def test_adaptive_ends_the_wait_at_a_lull() -> None:
    delay = BatchDelay("adaptive", MAX_US)
    last = arrivals(delay, 0, MS // 2, 40, company=True)
    deadline = delay.deadline_ns(oldest_ns=last)
    # Two expected gaps after the newest arrival, well before the 5 ms limit: a batch
    # planned 1.5 ms after the last arrival goes then, without waiting out the delay.
    assert deadline == last + MS
    assert deadline < last + MAX_US * 1000


def test_adaptive_learns_the_gap_of_a_faster_stream() -> None:
    delay = BatchDelay("adaptive", MAX_US)
    last = arrivals(delay, 0, 2 * MS, 40, company=True)
    slow_wait = delay.deadline_ns(oldest_ns=last) - last
    last = arrivals(delay, last + MS // 4, MS // 4, 40, company=True)
    fast_wait = delay.deadline_ns(oldest_ns=last) - last
    assert slow_wait == 4 * MS  # two gaps of 2 ms, under the 5 ms limit
    assert 0 < fast_wait < MS


def test_one_lone_arrival_in_a_busy_stream_does_not_stop_batching_but_a_quiet_spell_does() -> None:
    delay = BatchDelay("adaptive", MAX_US)
    last = arrivals(delay, 0, MS, 40, company=True)
    delay.arrived(last + MS, company=False)
    assert delay.deadline_ns(oldest_ns=last + MS) > last + MS  # still waits
    now = last + MS
    lone = 0
    while delay.deadline_ns(oldest_ns=now) > now:
        now += 3 * MS
        delay.arrived(now, company=False)
        lone += 1
    # The running share drops below one half within a handful of lone arrivals.
    assert 3 <= lone <= 6
    assert delay.company < 0.5


def test_a_zero_delay_never_waits_under_either_policy() -> None:
    for policy in ("adaptive", "fixed"):
        delay = BatchDelay(policy, 0)  # type: ignore[arg-type]
        last = arrivals(delay, 0, MS, 20, company=True)
        assert delay.deadline_ns(oldest_ns=last) == last


# -- where the policy is chosen ------------------------------------------------------


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse('name: "m"\nmax_batch_size: 8\n' + text, mc.ModelConfig())


POLICY_PARAMETER = 'parameters { key: "queue_delay_policy" value { string_value: "%s" } }\n'


def test_the_model_parameter_chooses_the_policy_and_adaptive_is_the_default() -> None:
    assert batch_policy(_config("dynamic_batching { }")).queue_delay_policy == "adaptive"
    fixed = _config("dynamic_batching { }\n" + POLICY_PARAMETER % "fixed")
    assert batch_policy(fixed).queue_delay_policy == "fixed"
    with pytest.raises(ConfigError, match="queue_delay_policy must be one of adaptive, fixed"):
        batch_policy(_config(POLICY_PARAMETER % "triton"))


def test_a_stage_wide_default_from_the_mesh_yaml_yields_to_the_model_parameter(
    tmp_path: Path,
) -> None:
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text("services:\n  inference:\n    default_queue_delay_policy: fixed\n")
    stage = load_config(StageConfig, ["--config", str(mesh)], {}, service="inference")
    defaults = stage.queue_defaults()
    assert batch_policy(_config("dynamic_batching { }"), 1, defaults).queue_delay_policy == "fixed"
    own = _config("dynamic_batching { }\n" + POLICY_PARAMETER % "adaptive")
    assert batch_policy(own, 1, defaults).queue_delay_policy == "adaptive"
    mesh.write_text("services:\n  inference:\n    default_queue_delay_policy: eager\n")
    with pytest.raises(ConfigError, match="default_queue_delay_policy"):
        load_config(StageConfig, ["--config", str(mesh)], {}, service="inference")


def test_a_lone_request_waits_only_where_company_is_expected() -> None:
    """The batcher runs a request at once when its delay would not hold it."""
    adaptive = BatchDelay("adaptive", 5000)
    assert not adaptive.waits_for_company()  # nothing learned: requests come alone
    for step in range(20):
        adaptive.arrived(step * 100_000, company=True)
    assert adaptive.waits_for_company()
    for step in range(20, 60):
        adaptive.arrived(step * 100_000, company=False)
    assert not adaptive.waits_for_company()
    assert BatchDelay("fixed", 5000).waits_for_company()  # Triton's: always the delay
    assert not BatchDelay("fixed", 0).waits_for_company()
