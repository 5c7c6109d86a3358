"""Fixtures shared by the test tree: prepared real models, test repositories, a trace receiver."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import RUNNING, ServiceProcess, log_tail
from tests.otlp import OtlpReceiver

DATA = Path(__file__).resolve().parent / "data"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say which CPU ran the suite (shown with -q too): answers must not depend on it."""
    terminalreporter.write_line(cpu_summary())


def cpu_summary() -> str:
    """The CPU's model and the instruction sets that change kernels (docs/cpu-independence.md)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cpu: unknown"
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in info.splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    flags = set(
        next(
            (
                line.split(":", 1)[1].split()
                for line in info.splitlines()
                if line.startswith("flags")
            ),
            [],
        )
    )
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return f"cpu: {model}; " + ", ".join(
        f"{flag}: {'yes' if flag in flags else 'no'}" for flag in wanted
    )


def cache_dir() -> Path:
    """Where prepared models live (the Makefile passes MESHSERVE_CACHE)."""
    return Path(os.environ.get("MESHSERVE_CACHE", Path.home() / ".cache" / "meshserve"))


@pytest.fixture(scope="session")
def prepared_repository() -> Path:
    """The default model repository, built once from the PyPI model wheels."""
    from models.prepare import prepare_repository

    return prepare_repository(cache_dir())


def affine_onnx(path: Path, scale: float = 2.0) -> None:
    """An ONNX model at ``path``: Y = X * scale + 1 over FP32 [-1, 4]."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["X", "scale"], ["scaled"]),
            helper.make_node("Add", ["scaled", "one"], ["Y"]),
        ],
        "affine",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [-1, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [-1, 4])],
        [
            helper.make_tensor("scale", TensorProto.FLOAT, [], [scale]),
            helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # readable by every ONNX Runtime the project allows
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def build_repository(
    target: Path, test_models: list[str], real_models: list[str], prepared: Path | None = None
) -> Path:
    """A repository folder with copies of test-data models and links to real ones."""
    target.mkdir(parents=True, exist_ok=True)
    for name in test_models:
        shutil.copytree(DATA / "models" / name, target / name)
    for name in real_models:
        assert prepared is not None
        (target / name).symlink_to(prepared / name, target_is_directory=True)
    return target


@pytest.fixture(scope="session")
def python_models_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository of the small python-backend test models."""
    return build_repository(tmp_path_factory.mktemp("pyrepo"), ["add_sub", "slow", "crash"], [])


@pytest.fixture(scope="session")
def python_service(python_models_repo: Path) -> Iterator[ServiceProcess]:
    """An inference service hosting the python test models."""
    service = ServiceProcess(
        "services.inference.main", ["--model-repository", str(python_models_repo)]
    )
    yield service
    service.stop()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    """An OTLP trace receiver for the services a test module starts."""
    otlp = OtlpReceiver()
    yield otlp
    otlp.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test's report ends with the logs of the services still running.

    A hang or an error on the client side often has its cause on the server's.
    """
    report = yield
    if report.failed:
        for pid, (module, log) in list(RUNNING.items()):
            report.sections.append((f"{module} (pid {pid}), last log lines", log_tail(log)))
    return report
