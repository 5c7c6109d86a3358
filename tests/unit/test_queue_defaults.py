"""A model config's queue bounds and timeouts as its batcher gets them: the
defaults when the config sets none, the config's own otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from inference import model_config_pb2 as mc
from shared.config import load_config
from shared.errors import ConfigError
from shared.queue_bounds import (
    DEFAULT_QUEUE_TIMEOUT_US,
    QUEUED_BATCHES_PER_INSTANCE,
    STREAMS_PER_INSTANCE,
    QueueDefaults,
    batch_policy,
    stream_limit,
)
from shared.stage import StageConfig


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse('name: "m"\n' + text, mc.ModelConfig())


def _parameter(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'


def test_a_config_without_queue_policy_gets_bounded_defaults() -> None:
    policy = batch_policy(_config("max_batch_size: 8\ndynamic_batching { }"), instances=2)
    queue = policy.queue_policy(1)
    assert queue.max_queue_size == QUEUED_BATCHES_PER_INSTANCE * 8 * 2
    assert queue.default_timeout_us == DEFAULT_QUEUE_TIMEOUT_US
    # A model without batching queues too, one request per "batch".
    unbatched = batch_policy(_config("max_batch_size: 0"), instances=3).queue_policy(1)
    assert unbatched.max_queue_size == QUEUED_BATCHES_PER_INSTANCE * 3


def test_tritons_queue_policy_and_the_parameters_replace_the_defaults() -> None:
    triton = _config(
        "max_batch_size: 8\ndynamic_batching { default_queue_policy "
        "{ max_queue_size: 5 default_timeout_microseconds: 700 } }"
    )
    queue = batch_policy(triton, instances=1).queue_policy(1)
    assert (queue.max_queue_size, queue.default_timeout_us) == (5, 700)
    unbounded = _config(
        "max_batch_size: 8\n"
        + _parameter("max_queue_size", "0")
        + _parameter("queue_timeout_us", "0")
    )
    queue = batch_policy(unbounded, instances=1).queue_policy(1)
    assert (queue.max_queue_size, queue.default_timeout_us) == (0, 0)
    assert stream_limit(_config(_parameter("max_queue_size", "7")), instances=2) == 7
    assert stream_limit(_config(""), instances=2) == 2 * STREAMS_PER_INSTANCE


def test_a_bad_bound_is_a_config_error_naming_the_parameter() -> None:
    with pytest.raises(ConfigError, match="max_queue_size"):
        batch_policy(_config(_parameter("max_queue_size", "-1")))


def test_a_stage_wide_default_from_the_mesh_yaml_replaces_the_built_in_one(
    tmp_path: Path,
) -> None:
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(
        "services:\n  inference:\n    default_queued_batches: 2\n"
        "    default_queue_timeout_s: 0.5\n    default_streams_per_instance: 3\n"
    )
    stage = load_config(
        StageConfig, ["--config", str(mesh)], {}, service="inference"
    ).queue_defaults()
    assert stage == QueueDefaults(2, 500_000, 3)
    queue = batch_policy(_config("max_batch_size: 4\ndynamic_batching { }"), 2, stage).queue_policy(
        1
    )
    assert (queue.max_queue_size, queue.default_timeout_us) == (2 * 4 * 2, 500_000)
    assert stream_limit(_config(""), instances=2, defaults=stage) == 6
    # A model's own bound still wins over the stage's.
    own = _config("max_batch_size: 4\n" + _parameter("max_queue_size", "5"))
    assert batch_policy(own, 2, stage).queue_policy(1).max_queue_size == 5
    other = load_config(StageConfig, ["--config", str(mesh)], {}, service="tokenizer")
    assert other.queue_defaults() == QueueDefaults()
