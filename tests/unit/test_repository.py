"""The model repository reader: layout, version policy, and errors naming file and line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shared.errors import ConfigError, NotFound
from shared.repository import (
    ModelRepository,
    is_ensemble,
    parse_config,
    unsupported_fields,
    validate_config,
)

ONNX_CONFIG = """
name: "resnet"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 10 ] } ]
"""


def make_model(root: Path, name: str, config: str, versions: tuple[int, ...] = (1,)) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.pbtxt").write_text(config)
    for version in versions:
        (folder / str(version)).mkdir()
    return folder


def test_lists_models_with_a_config(tmp_path: Path) -> None:
    make_model(tmp_path, "resnet", ONNX_CONFIG)
    (tmp_path / "not_a_model").mkdir()
    repo = ModelRepository(tmp_path)
    assert repo.names() == ["resnet"]
    entry = repo.entry("resnet")
    assert entry.config.max_batch_size == 8
    assert entry.config.input[0].dims == [3, -1, -1]
    assert not is_ensemble(entry.config)  # a stage hosts it, not the orchestrator


def test_a_rewritten_config_is_read_again_and_an_unchanged_one_is_not_reparsed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = make_model(tmp_path, "resnet", ONNX_CONFIG + "optimization {}")
    repo = ModelRepository(tmp_path)
    with caplog.at_level(logging.WARNING, logger="shared.repository"):
        first = repo.entry("resnet")
        first.config.max_batch_size = 99  # a caller's change stays in its copy
        assert repo.entry("resnet").config.max_batch_size == 8
    # The unsupported-field warning comes from parsing: once for one text.
    assert [r.getMessage() for r in caplog.records].count(
        f"{folder / 'config.pbtxt'}: field 'optimization' is parsed but not supported; "
        "it has no effect"
    ) == 1
    # Same length, written at once: a stat-based cache could miss this.
    (folder / "config.pbtxt").write_text(
        (ONNX_CONFIG + "optimization {}").replace("max_batch_size: 8", "max_batch_size: 4")
    )
    assert repo.entry("resnet").config.max_batch_size == 4


def test_default_policy_serves_the_latest_version(tmp_path: Path) -> None:
    make_model(tmp_path, "resnet", ONNX_CONFIG, versions=(1, 3, 2, 10))
    assert ModelRepository(tmp_path).entry("resnet").selected_versions() == (10,)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("version_policy: { latest: { num_versions: 2 } }", (3, 10)),
        ("version_policy: { all: {} }", (1, 2, 3, 10)),
        ("version_policy: { specific: { versions: [ 1, 3 ] } }", (1, 3)),
    ],
)
def test_version_policies(tmp_path: Path, policy: str, expected: tuple[int, ...]) -> None:
    make_model(tmp_path, "resnet", ONNX_CONFIG + policy, versions=(1, 2, 3, 10))
    assert ModelRepository(tmp_path).entry("resnet").selected_versions() == expected


def test_specific_version_without_a_folder_is_an_error(tmp_path: Path) -> None:
    make_model(
        tmp_path, "resnet", ONNX_CONFIG + "version_policy: { specific: { versions: [ 4 ] } }"
    )
    with pytest.raises(ConfigError, match=r"versions \[4\] that have no folder"):
        ModelRepository(tmp_path).entry("resnet").selected_versions()


def test_syntax_error_names_file_line_and_problem(tmp_path: Path) -> None:
    bad = ONNX_CONFIG.replace("max_batch_size: 8", "max_batch_size: eight")
    folder = make_model(tmp_path, "resnet", bad)
    with pytest.raises(ConfigError) as caught:
        ModelRepository(tmp_path).entry("resnet")
    message = caught.value.message
    # The file as a path in the repository: errors reach callers, not the server's folders.
    assert message.startswith("resnet/config.pbtxt:4:")
    assert str(folder) not in message
    assert "max_batch_size" in message


def test_unknown_field_names_the_field_and_line(tmp_path: Path) -> None:
    make_model(tmp_path, "resnet", ONNX_CONFIG + "\nmax_batch_sizes: 4\n")
    with pytest.raises(ConfigError, match=r"config.pbtxt:8:.*max_batch_sizes"):
        ModelRepository(tmp_path).entry("resnet")


def test_semantic_errors_are_named(tmp_path: Path) -> None:
    make_model(
        tmp_path,
        "resnet",
        ONNX_CONFIG.replace('name: "y"', 'name: "x"').replace("output [", "input ["),
    )
    with pytest.raises(ConfigError, match="input 'x' is declared twice"):
        ModelRepository(tmp_path).entry("resnet")


def test_name_must_match_folder(tmp_path: Path) -> None:
    make_model(tmp_path, "other", ONNX_CONFIG)
    with pytest.raises(ConfigError, match="'resnet' differs from its folder name 'other'"):
        ModelRepository(tmp_path).entry("other")


def test_unsupported_fields_parse_and_are_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    extra = "response_cache { enable: true }\noptimization { priority: PRIORITY_MAX }\n"
    make_model(tmp_path, "resnet", ONNX_CONFIG + extra)
    with caplog.at_level(logging.WARNING):
        entry = ModelRepository(tmp_path).entry("resnet")
    assert entry.config.response_cache.enable
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert "'optimization' is parsed but not supported" in warned
    assert "'response_cache' is parsed but not supported" in warned


def test_unknown_model_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="model 'ghost'"):
        ModelRepository(tmp_path).entry("ghost")


def test_real_triton_configs_from_test_data_load() -> None:
    root = Path(__file__).resolve().parent.parent / "data" / "configs"
    onnx = parse_config(root / "onnx_dynamic" / "config.pbtxt")
    validate_config(onnx, root)
    assert onnx.dynamic_batching.max_queue_delay_microseconds > 0
    assert len(onnx.instance_group) >= 1
    assert "optimization" in unsupported_fields(onnx)
    ensemble = parse_config(root / "ensemble" / "config.pbtxt")
    assert is_ensemble(ensemble)
    assert len(ensemble.ensemble_scheduling.step) >= 2
