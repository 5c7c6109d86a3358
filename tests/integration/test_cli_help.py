"""Every service's ``--help`` describes every flag, as a user running it reads it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ENTRY_POINTS = [
    "services.orchestrator.main",
    "services.inference.main",
    "services.tokenizer.main",
    "services.preprocess.main",
    "services.postprocess.main",
    "gateway.http.main",
    "gateway.envoy.main",
    "deploy.local.supervisor",
]


def _help_text(module: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'protos'}", "COLUMNS": "100"}
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{module} --help exited {done.returncode}:\n{done.stderr[-2000:]}"
    return done.stdout


def _flag_helps(text: str) -> dict[str, str]:
    """Each option's flag -> the help text argparse printed for it."""
    options = text.split("\noptions:\n", 1)[1]
    helps: dict[str, str] = {}
    for entry in re.split(r"\n(?=  -)", options):
        first, *rest = entry.splitlines()
        # The invocation ("--grpc-port GRPC_PORT") ends at two spaces or the line's end.
        match = re.match(r"\s+(\S(?:.*?\S)?)(?:\s{2,}(.*))?$", first)
        assert match is not None, f"unexpected --help line {first!r}"
        flag = match.group(1).split()[0].rstrip(",")
        helps[flag] = " ".join([match.group(2) or "", *(line.strip() for line in rest)]).strip()
    return helps


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_flag_has_a_description(module: str) -> None:
    helps = _flag_helps(_help_text(module))
    assert "--config" in helps
    assert len(helps) >= 4, f"{module}: too few flags parsed from --help: {sorted(helps)}"
    for flag, text in helps.items():
        description = text.split("(default:")[0].split("(repeatable")[0].strip()
        assert len(description.split()) >= 3, (
            f"{module} {flag}: no description in --help (got {text!r})"
        )


def test_service_flags_show_defaults_and_environment() -> None:
    helps = _flag_helps(_help_text("services.inference.main"))
    assert "(default: 8003; env MESHSERVE_GRPC_PORT)" in helps["--grpc-port"]
    assert "gRPC port of the inference service" in helps["--grpc-port"]
    # The service's own name, not the class default, is what it runs with.
    assert "default: inference;" in helps["--service-name"]
    assert "repeatable" in helps["--load-models"]
