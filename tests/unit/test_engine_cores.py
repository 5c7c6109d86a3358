"""The CPU contract between placement and engines (shared/engine_cores.py)."""

from __future__ import annotations

import os
import threading

import pytest

from shared.engine_cores import (
    ENGINE_CORES_ENV,
    binds_openmp,
    engine_cores,
    enter_engine_cores,
    format_cores,
    parse_cores,
)

ALL_CORES = frozenset(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("cores", "text"),
    [({0}, "0"), ({0, 1, 2, 5}, "0-2,5"), ({3, 7, 8, 9, 11}, "3,7-9,11"), (set(), "")],
)
def test_cpu_lists_read_and_write_as_linux_does(cores: set[int], text: str) -> None:
    assert format_cores(cores) == text
    assert parse_cores(text) == frozenset(cores)


def test_a_malformed_cpu_list_names_the_variable() -> None:
    with pytest.raises(ValueError, match=ENGINE_CORES_ENV):
        parse_cores("0-x")


def test_engine_cores_come_from_the_variable_else_the_process() -> None:
    assert engine_cores({ENGINE_CORES_ENV: "0,2-3"}) == {0, 2, 3}
    assert engine_cores({}) == ALL_CORES


def test_only_an_openmp_binding_marks_an_engine() -> None:
    assert binds_openmp([b"PATH=/bin", b"OMP_PLACES={1}"])
    assert binds_openmp([b"GOMP_CPU_AFFINITY=1"])
    assert not binds_openmp([b"PATH=/bin", b"OMP_NUM_THREADS=2"])


@pytest.mark.skipif(len(ALL_CORES) < 2, reason="needs 2 cores or more")
def test_a_narrowed_thread_starts_its_engine_on_the_engine_cores() -> None:
    seen: list[frozenset[int]] = []

    def spawner() -> None:
        # As placement leaves a stage's thread while an engine is busy.
        os.sched_setaffinity(0, {min(ALL_CORES)})
        enter_engine_cores(ALL_CORES)
        seen.append(frozenset(os.sched_getaffinity(0)))

    thread = threading.Thread(target=spawner)
    thread.start()
    thread.join()
    assert seen == [ALL_CORES]
    assert frozenset(os.sched_getaffinity(0)) == ALL_CORES  # only that thread moved
