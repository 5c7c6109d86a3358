"""Real-world Triton config.pbtxt files parse into our inference.ModelConfig.

The model repository reads every model's config with protobuf text_format, so
a field missing from protos/inference/model_config.proto (or a wrong type or
enum value) makes a user's existing Triton config fail to load. The samples in
tests/data/configs use fields meshserve does not implement on purpose.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from inference import model_config_pb2 as mc

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def load(name: str) -> mc.ModelConfig:
    """Parse tests/data/configs/<name>/config.pbtxt as Triton does."""
    text = (CONFIGS / name / "config.pbtxt").read_text()
    return text_format.Parse(text, mc.ModelConfig())


def test_ensemble_config_parses_steps_and_tensor_maps() -> None:
    config = load("ensemble")

    assert config.name == "minilm_embed"
    assert config.platform == "ensemble"
    assert config.max_batch_size == 32
    assert config.WhichOneof("scheduling_choice") == "ensemble_scheduling"
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("TEXT", mc.TYPE_STRING, [1])
    ]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [
        ("EMBEDDING", mc.TYPE_FP32, [384])
    ]

    steps = config.ensemble_scheduling.step
    assert [(s.model_name, s.model_version) for s in steps] == [
        ("minilm_tokenizer", -1),
        ("minilm_onnx", 1),
        ("mean_pool", -1),
    ]
    # Maps written both as repeated blocks and as a list must merge the same way.
    assert dict(steps[0].output_map) == {
        "input_ids": "token_ids",
        "attention_mask": "attention_mask",
    }
    assert dict(steps[1].input_map) == {
        "input_ids": "token_ids",
        "attention_mask": "attention_mask",
    }
    assert dict(steps[2].input_map) == {"HIDDEN": "hidden", "MASK": "attention_mask"}
    assert dict(steps[2].output_map) == {"POOLED": "EMBEDDING"}
    assert config.parameters["normalize"].string_value == "true"


def test_onnx_config_parses_batching_and_queue_policies() -> None:
    config = load("onnx_dynamic")

    assert (config.name, config.backend, config.max_batch_size) == (
        "mobilenet_v2",
        "onnxruntime",
        64,
    )
    assert config.version_policy.WhichOneof("policy_choice") == "latest"
    assert config.version_policy.latest.num_versions == 2
    assert config.input[0].format == mc.ModelInput.FORMAT_NCHW
    assert list(config.input[0].dims) == [3, 224, 224]
    assert config.input[1].optional is True
    assert config.input[1].HasField("reshape") and list(config.input[1].reshape.shape) == []
    assert config.output[0].label_filename == "imagenet_labels.txt"

    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    batching = config.dynamic_batching
    assert list(batching.preferred_batch_size) == [16, 32]
    assert batching.max_queue_delay_microseconds == 500
    assert batching.preserve_ordering is True
    assert (batching.priority_levels, batching.default_priority_level) == (2, 2)
    default_policy = batching.default_queue_policy
    assert default_policy.timeout_action == mc.ModelQueuePolicy.DELAY
    assert default_policy.default_timeout_microseconds == 100_000
    assert default_policy.allow_timeout_override is True
    assert default_policy.max_queue_size == 256
    # priority_queue_policy is a map<uint64, ModelQueuePolicy>.
    assert set(batching.priority_queue_policy) == {1}
    high = batching.priority_queue_policy[1]
    assert (high.timeout_action, high.max_queue_size) == (mc.ModelQueuePolicy.REJECT, 64)


def test_onnx_config_parses_instances_and_unimplemented_sections() -> None:
    config = load("onnx_dynamic")

    gpu_group, cpu_group = config.instance_group
    assert (gpu_group.name, gpu_group.kind, gpu_group.count) == (
        "mobilenet_gpu",
        mc.ModelInstanceGroup.KIND_GPU,
        2,
    )
    assert list(gpu_group.gpus) == [0, 1]
    assert gpu_group.rate_limiter.resources[0].name == "gpu_mem_slot"
    assert gpu_group.rate_limiter.resources[0].count == 4
    assert (cpu_group.kind, cpu_group.count) == (mc.ModelInstanceGroup.KIND_CPU, 1)

    accelerators = config.optimization.execution_accelerators
    (trt,) = accelerators.gpu_execution_accelerator
    assert trt.name == "tensorrt"
    assert dict(trt.parameters) == {
        "precision_mode": "FP16",
        "max_workspace_size_bytes": "1073741824",
    }
    assert [a.name for a in accelerators.cpu_execution_accelerator] == ["openvino"]
    assert config.optimization.graph.level == 1
    assert config.optimization.cuda.graphs is True
    assert config.optimization.HasField("input_pinned_memory")
    assert config.optimization.input_pinned_memory.enable is False

    assert config.response_cache.enable is True
    zeros, random = config.model_warmup
    assert (zeros.name, zeros.batch_size, zeros.count) == ("zeros_batch_8", 8, 3)
    assert zeros.inputs["input"].WhichOneof("input_data_type") == "zero_data"
    assert list(zeros.inputs["input"].dims) == [3, 224, 224]
    assert random.inputs["input"].WhichOneof("input_data_type") == "random_data"
    assert config.parameters["intra_op_thread_count"].string_value == "4"
    (metric,) = config.model_metrics.metric_control
    assert metric.metric_identifier.family == "nv_inference_first_response_histogram_ms"
    assert list(metric.histogram_options.buckets) == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert config.HasField("model_transaction_policy")
    assert config.model_transaction_policy.decoupled is False


@pytest.mark.parametrize("name", ["ensemble", "onnx_dynamic"])
def test_config_round_trips_through_text_and_wire(name: str) -> None:
    # The server returns parsed configs over gRPC (ModelConfig RPC) and may
    # write them back as text; neither form may lose a field.
    config = load(name)
    again = text_format.Parse(text_format.MessageToString(config), mc.ModelConfig())
    assert again == config
    assert mc.ModelConfig.FromString(config.SerializeToString()) == config


def test_unknown_field_is_rejected() -> None:
    # A typo in config.pbtxt must fail loudly at load time, not be dropped.
    with pytest.raises(text_format.ParseError, match="max_batch_sise"):
        text_format.Parse('name: "m" max_batch_sise: 8', mc.ModelConfig())
