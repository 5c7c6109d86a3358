"""The mesh's Prometheus rules load and behave: promtool checks and unit-tests them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian package prometheus: make system-packages)",
)


def promtool(*args: str) -> str:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *args], cwd=RULES, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@needs_promtool
def test_rules_are_valid() -> None:
    out = promtool("check", "rules", "rules.yml")
    assert "SUCCESS: 17 rules found" in out


@needs_promtool
def test_alerts_fire_on_their_series_and_only_there() -> None:
    tests = sorted(str(p.relative_to(RULES)) for p in (RULES / "tests").glob("*_test.yml"))
    assert tests
    promtool("test", "rules", *tests)


@needs_promtool
def test_a_broken_rule_test_fails(tmp_path: Path) -> None:
    """The runner notices a wrong expectation (so the passing tests mean something)."""
    wrong = (
        (RULES / "tests" / "rules_test.yml")
        .read_text()
        .replace('summary: "busy: queue 90% full"', 'summary: "busy: queue 10% full"')
    )
    (tmp_path / "rules.yml").write_text((RULES / "rules.yml").read_text())
    (tmp_path / "case_test.yml").write_text(wrong.replace("../rules.yml", "rules.yml"))
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "test", "rules", "case_test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "ModelQueueNearBound" in done.stdout + done.stderr
