"""shared/cpu_policy.py: every thread of the process under the configured policy,
and what the process starts afterwards under it too."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from shared import cpu_policy
from shared.config import ServiceConfig, load_config
from shared.errors import ConfigError
from shared.stage import StageConfig

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling only")


@pytest.fixture
def restored() -> Iterator[None]:
    """This test process goes back to the kernel's default policy afterwards."""
    yield
    cpu_policy.apply("normal")


def _policy_in_thread() -> str | None:
    seen: list[str | None] = []
    thread = threading.Thread(target=lambda: seen.append(cpu_policy.current()))
    thread.start()
    thread.join()
    return seen[0]


def test_batch_takes_every_thread_and_what_starts_after(restored: None) -> None:
    started = threading.Event()
    finish = threading.Event()

    def waiting() -> None:
        started.set()
        finish.wait(10)

    earlier = threading.Thread(target=waiting)
    earlier.start()
    started.wait(10)
    try:
        assert cpu_policy.apply("batch") >= 2  # this thread and the one waiting
        assert earlier.native_id is not None
        assert cpu_policy.current(earlier.native_id) == "batch"
    finally:
        finish.set()
        earlier.join()
    assert cpu_policy.current() == "batch"
    assert _policy_in_thread() == "batch"
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(child.stdout) == os.SCHED_BATCH


def test_normal_sets_the_kernel_s_default_back(restored: None) -> None:
    cpu_policy.apply("batch")
    cpu_policy.apply("normal")
    assert cpu_policy.current() == "normal"
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert _policy_in_thread() == "normal"


def test_front_doors_default_to_batch_stages_to_normal_and_flags_and_env_say_otherwise() -> None:
    assert ServiceConfig().cpu_policy == "batch"
    assert StageConfig().cpu_policy == "normal"
    flag = load_config(ServiceConfig, ["--cpu-policy", "normal"], {}, service="stage")
    assert flag.cpu_policy == "normal"
    env = load_config(ServiceConfig, [], {"MESHSERVE_CPU_POLICY": "normal"}, service="stage")
    assert env.cpu_policy == "normal"


def test_an_unknown_policy_is_refused_naming_the_setting() -> None:
    with pytest.raises((ConfigError, ValueError), match="cpu_policy"):
        ServiceConfig(cpu_policy="realtime")  # type: ignore[arg-type]
