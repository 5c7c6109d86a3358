"""Serialise the project's models into Triton version folders, and check each result.

Every writer builds the eager model, serialises it, loads the file back and
compares it with the eager output, so a broken trace or export fails here, at
build time, instead of inside a serving process. ``models.prepare`` decides
what to build and installs the folders; this module only writes files.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from models import minilm, sources
from models.mlp import IN_FEATURES, build_mlp
from models.mobilenet_v2 import load_mobilenet_v2

IMAGE_SHAPE = (3, 224, 224)
# The batch used for tracing and export; >1 so nothing specialises on batch 1.
EXAMPLE_BATCH = 2
# TorchScript reproduces eager kernels; ONNX Runtime fuses BatchNorm, so it drifts slightly.
TORCHSCRIPT_ATOL = 1e-5
ONNX_ATOL = 1e-4
EXPORT_SEED = 0


# Sentences for the MiniLM export and its check: different lengths, so the
# batch is padded and the padded positions are exercised.
MINILM_EXAMPLE = ("A man is playing a guitar.", "Hello!")
MINILM_CHECK = (
    "The stock market fell sharply today, after a week of gains. " * 3,
    "Short.",
    "Someone plays an acoustic guitar.",
)


class ExportMismatch(RuntimeError):
    """A serialised model disagrees with the eager model it was made from."""


@contextmanager
def _deprecated_exporters_allowed() -> Iterator[None]:
    """Silence torch's deprecation notices for TorchScript and the legacy ONNX exporter.

    torch 2.13 marks torch.jit.trace/save/load and ``onnx.export(dynamo=False)``
    deprecated, but TorchScript is the Triton pytorch backend's format and the
    TorchScript-based exporter is the one that handles dynamic batch here in
    about a second. Only these messages are hidden, so that pytest's
    ``filterwarnings = error`` still catches anything else.
    """
    with warnings.catch_warnings():
        for message in (
            r"`torch\.jit\.\w+` is deprecated",
            r"You are using the legacy TorchScript-based ONNX export",
            r"The feature will be removed",
        ):
            warnings.filterwarnings("ignore", message=message, category=DeprecationWarning)
        yield


def load_torchscript(path: Path) -> torch.jit.ScriptModule:
    """Load a TorchScript file on CPU without torch's deprecation notice."""
    with _deprecated_exporters_allowed():
        # torch.jit has no type hints; the result is a ScriptModule by contract.
        module: torch.jit.ScriptModule = torch.jit.load(  # type: ignore[no-untyped-call]
            str(path), map_location="cpu"
        )
    return module


def _example_input(*shape: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(EXPORT_SEED)
    return torch.randn(EXAMPLE_BATCH, *shape, generator=generator)


def _check_close(name: str, got: np.ndarray, want: np.ndarray, atol: float) -> None:
    error = float(np.max(np.abs(got - want)))
    if error > atol:
        raise ExportMismatch(f"{name}: max abs error {error:.2e} exceeds {atol:.0e}")


@torch.no_grad()
def _write_torchscript(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    """Trace ``model`` to ``path`` and check that the file reproduces it."""
    # Not frozen: freezing bakes CPU weights in as constants that .to("cuda") won't move.
    # check_trace=False: the reload comparison below is the stronger check, and 4x cheaper.
    with _deprecated_exporters_allowed():
        traced = torch.jit.trace(  # type: ignore[no-untyped-call]
            model, example, check_trace=False
        )
        traced.save(str(path))
    reloaded = load_torchscript(path)
    _check_close(path.name, reloaded(example).numpy(), model(example).numpy(), TORCHSCRIPT_ATOL)


def write_mlp_torchscript(version_dir: Path) -> Path:
    """``<version_dir>/model.pt``: the seeded MLP, traced."""
    path = version_dir / "model.pt"
    _write_torchscript(build_mlp(), _example_input(IN_FEATURES), path)
    return path


def write_mobilenet_v2_torchscript(version_dir: Path) -> Path:
    """``<version_dir>/model.pt``: MobileNetV2 with ImageNet weights, traced."""
    path = version_dir / "model.pt"
    model = load_mobilenet_v2(sources.mobilenet_v2_weights())
    _write_torchscript(model, _example_input(*IMAGE_SHAPE), path)
    return path


@torch.no_grad()
def write_mobilenet_v2_onnx(version_dir: Path) -> Path:
    """``<version_dir>/model.onnx``: MobileNetV2 with a dynamic batch axis, checked in ORT."""
    path = version_dir / "model.onnx"
    model = load_mobilenet_v2(sources.mobilenet_v2_weights())
    example = _example_input(*IMAGE_SHAPE)
    with _deprecated_exporters_allowed():
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=False,
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(["logits"], {"input": example.numpy()})
    _check_close(path.name, got, model(example).numpy(), ONNX_ATOL)
    return path


@contextmanager
def _transformers_quiet() -> Iterator[None]:
    """Load and trace a transformers model without its noise reaching the caller.

    Hides the weight-loading progress bar and the tracer's notes on
    transformers' mask code (a Python-level check on equal query and key lengths,
    which holds for every encoder input, and a 0.0 constant), plus the legacy
    exporter's note on indexing; the export is checked numerically at two other
    shapes instead. Only these messages are hidden, so pytest's
    ``filterwarnings = error`` still catches anything else.
    """
    from transformers.utils import logging as hf_logging

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        with _deprecated_exporters_allowed(), warnings.catch_warnings():
            # torch.jit does not re-export TracerWarning for type checkers; it is public.
            tracer_warning = torch.jit.TracerWarning  # type: ignore[attr-defined]
            warnings.filterwarnings("ignore", category=tracer_warning, module=r"transformers\.")
            warnings.filterwarnings(
                "ignore", message=r"Exporting aten::index operator", category=UserWarning
            )
            yield
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


class _MiniLMEncoder(nn.Module):
    """BertModel with positional inputs and the token embeddings as its only output.

    all-MiniLM-L6-v2 pools the token embeddings (mean over the attention mask),
    so the encoder leaves out BERT's pooler head.
    """

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.bert(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        return hidden


def _load_minilm_encoder() -> nn.Module:
    from transformers import BertModel

    # Eager attention traces into plain ONNX ops; SDPA would need opset-specific handling.
    bert = BertModel.from_pretrained(
        str(sources.minilm_dir()), attn_implementation="eager", local_files_only=True
    )
    return _MiniLMEncoder(bert).eval()


@torch.no_grad()
def write_minilm_onnx(version_dir: Path) -> Path:
    """``<version_dir>/model.onnx``: MiniLM encoder, dynamic batch and length, checked in ORT."""
    path = version_dir / "model.onnx"
    tokenizer = minilm.configured_tokenizer(sources.minilm_file(minilm.TOKENIZER_FILE))
    names = [*minilm.ENCODER_INPUTS, minilm.ENCODER_OUTPUT]
    with _transformers_quiet():
        model = _load_minilm_encoder()
        example = minilm.encode(tokenizer, MINILM_EXAMPLE)
        torch.onnx.export(
            model,
            tuple(torch.from_numpy(example[name]) for name in minilm.ENCODER_INPUTS),
            str(path),
            dynamo=False,
            input_names=list(minilm.ENCODER_INPUTS),
            output_names=[minilm.ENCODER_OUTPUT],
            dynamic_axes={name: {0: "batch", 1: "sequence"} for name in names},
        )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    # The export's own batch, then a longer and wider one: the axes must really be dynamic.
    for texts in (MINILM_EXAMPLE, MINILM_CHECK):
        inputs = minilm.encode(tokenizer, texts)
        (got,) = session.run([minilm.ENCODER_OUTPUT], inputs)
        want = model(*(torch.from_numpy(inputs[name]) for name in minilm.ENCODER_INPUTS))
        _check_close(path.name, np.asarray(got), want.numpy(), ONNX_ATOL)
    return path
