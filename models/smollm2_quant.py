"""An int8 (W8A8) variant of SmolLM2 in the compressed-tensors format vLLM loads.

The scheme is the one vLLM runs on x86 CPUs (oneDNN int8 GEMMs,
``CPUInt8ScaledMMLinearKernel``) and on CUDA (cutlass): weights int8,
symmetric, one scale per output channel; activations int8, symmetric, one
scale per token computed at run time (dynamic), so no calibration data is
needed. Written directly with the ``compressed-tensors`` package's own config
objects (the quantization_config vLLM reads), from the prepared float model::

    load      the prepared smollm2 safetensors (bfloat16), widened to float32
    quantize  every decoder Linear (q/k/v/o, gate/up/down): int8 weight + float32
              weight_scale [out, 1]; embeddings, norms and the tied lm_head stay float
    save      model.safetensors, config.json with quantization_config, the rest copied

Module level imports only the standard library.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from models import smollm2

QUANT_NAME = "smollm2_w8a8"
BASE_MODEL = "smollm2"
QUANTIZED_SUFFIXES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
QUANT_FILES = ("model.safetensors", "config.json", *COPIED)
QUANT_FOLDER = "optional"
"""Where in the cache the folder is built (beside ``repository``): a second engine
costs its start-up and memory, so it joins a repository only where asked for."""


QUANT_CONFIG = smollm2.MODEL_CONFIG.replace(f'name: "{BASE_MODEL}"', f'name: "{QUANT_NAME}"', 1)
"""smollm2's config.pbtxt (float32 compute, the same tensors and engine settings)."""


def base_folder(version_dir: Path) -> Path:
    """The prepared base model's version folder (``<cache>/repository/smollm2/1``)."""
    return version_dir.resolve().parents[2] / "repository" / BASE_MODEL / "1"


def quantization_config() -> dict[str, Any]:
    """The compressed-tensors quantization_config of W8A8 int8 (channel / dynamic token)."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )

    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    activations = QuantizationArgs(
        num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        quant_method="compressed-tensors",
        format="int-quantized",
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=["lm_head"],
    )
    dumped: dict[str, Any] = config.model_dump(exclude_none=True)
    plain: dict[str, Any] = json.loads(json.dumps(dumped, default=str))
    return plain


def quantize(weight: Any) -> tuple[Any, Any]:
    """int8 weight and float32 per-row scale of one float weight [out, in]."""
    import torch

    wide = weight.to(torch.float32)
    scale = wide.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    quantized = torch.round(wide / scale).clamp(-128, 127).to(torch.int8)
    return quantized, scale


def write_quantized(version_dir: Path) -> Path:
    """The W8A8 folder of the prepared smollm2, written into ``version_dir``."""
    import torch
    from safetensors.torch import load_file, save_file

    base = base_folder(version_dir)
    tensors = load_file(str(base / "model.safetensors"))
    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.endswith(QUANTIZED_SUFFIXES):
            out[name], out[f"{module}.weight_scale"] = quantize(tensor)
        else:
            out[name] = tensor.to(torch.float32)
    save_file(out, str(version_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = quantization_config()
    config["torch_dtype"] = "float32"
    (version_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for name in COPIED:
        shutil.copyfile(base / name, version_dir / name)
    for path in version_dir.iterdir():
        path.chmod(0o644)
    return version_dir / "model.safetensors"
