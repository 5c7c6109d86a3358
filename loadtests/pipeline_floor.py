"""The steps of a pipeline in one process: the floor ``bench_pipeline.py`` holds the mesh to.

Each pipeline is three steps, as its ensemble lists them, run by the stages' own
instance classes (same sessions and settings as the servers give them; the ORT
session gets every core for its operators even where the mesh's config gives its
stage fewer, so the floor is never weaker than one process can be):

- ``first``  one request's input -> its prepared item (image decode and resize,
             tokenization): per request, so the batched floor can spread it over
             a thread pool;
- ``stack``  items -> one batch;
- ``second`` the model on the batch (ONNX Runtime);
- ``third``  the model's outputs -> the answer (top-5, mean pooling).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from services.inference.onnx import OnnxInstance
from services.postprocess.classify import ClassifyInstance, softmax_top_k
from services.postprocess.pool import EmbeddingPoolInstance
from services.preprocess.backend import transform_config
from services.preprocess.transform import TransformConfig, preprocess
from services.tokenizer.backend import TokenizerInstance
from shared.backend import ModelSpec, config_parameters, default_intra_op_threads
from shared.instances import instance_specs
from shared.repository import ModelRepository
from shared.request import InferRequest, InferResponse


def model_spec(repository: ModelRepository, name: str) -> ModelSpec:
    """The ModelSpec a stage service builds for the newest served version of ``name``."""
    entry = repository.entry(name)
    version = entry.selected_versions()[-1]
    return ModelSpec(
        entry.name,
        version,
        entry.version_path(version),
        entry.config,
        config_parameters(entry.config),
    )


def _instance(repository: ModelRepository, name: str, kind: type[Any]) -> Any:
    """The stage's instance class for ``name``, as a CPU host would build its first one."""
    spec = model_spec(repository, name)
    return kind(spec, instance_specs(spec.config, 0)[0])


def _session(repository: ModelRepository, name: str) -> OnnxInstance:
    """The model's ORT session as its stage builds it, with every core for its
    operators whatever thread count the mesh's config gives the stage: a
    one-process server would give its only model all of them."""
    spec = model_spec(repository, name)
    first = instance_specs(spec.config, 0)[0]
    return OnnxInstance(spec, replace(first, intra_op_threads=default_intra_op_threads(1)))


def _only(results: list[InferResponse | Exception]) -> InferResponse:
    result = results[0]
    if isinstance(result, Exception):
        raise result
    return result


class StepFloor(Protocol):
    """A pipeline's three steps as plain calls."""

    steps: tuple[str, str, str]
    """The step models, in order."""

    def first(self, data: bytes) -> Any:
        """One request's input -> its prepared item."""
        ...

    def stack(self, items: list[Any]) -> Any:
        """Prepared items -> one batch."""
        ...

    def second(self, batch: Any) -> Any:
        """The model on a batch."""
        ...

    def third(self, outputs: Any) -> Any:
        """The model's outputs -> the answer."""
        ...

    def describe(self, answer: Any) -> str:
        """The first row's answer, for the log."""
        ...


class ImageFloor:
    """image_preprocess -> mobilenet_v2_onnx -> imagenet_top5."""

    steps = ("image_preprocess", "mobilenet_v2_onnx", "imagenet_top5")

    def __init__(self, root: Path) -> None:
        repository = ModelRepository(root)
        self.transform: TransformConfig = transform_config(model_spec(repository, self.steps[0]))
        self.session = _session(repository, self.steps[1])
        classify = _instance(repository, self.steps[2], ClassifyInstance)
        self.labels, self.top_k = classify.labels, classify.top_k

    def first(self, data: bytes) -> np.ndarray:
        """Image bytes -> float32 [3, 224, 224]."""
        pixels: np.ndarray = preprocess(data, self.transform)
        return pixels

    def stack(self, items: list[np.ndarray]) -> np.ndarray:
        """[B, 3, 224, 224]."""
        return np.stack(items)

    def second(self, batch: np.ndarray) -> np.ndarray:
        """Pixels [B, 3, 224, 224] -> logits [B, 1000]."""
        logits: np.ndarray = self.session.run({"input": batch})["logits"]
        return logits

    def third(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Logits -> (labels, probabilities), each [B, top_k], best first."""
        indices, probabilities = softmax_top_k(logits, self.top_k)
        return self.labels[indices], probabilities

    def describe(self, answer: tuple[np.ndarray, np.ndarray]) -> str:
        """Top-1 label and probability."""
        labels, probabilities = answer
        return f"top-1 {labels[0][0].decode()} {probabilities[0][0]:.3f}"


class TextFloor:
    """minilm_tokenizer -> minilm -> mean_pool."""

    steps = ("minilm_tokenizer", "minilm", "mean_pool")

    def __init__(self, root: Path) -> None:
        repository = ModelRepository(root)
        self.tokenizer = _instance(repository, self.steps[0], TokenizerInstance)
        self.session = _session(repository, self.steps[1])
        self.pool = _instance(repository, self.steps[2], EmbeddingPoolInstance)

    def first(self, data: bytes) -> dict[str, np.ndarray]:
        """One text -> input_ids, attention_mask, token_type_ids, each [L]."""
        text = np.empty((1, 1), dtype=object)
        text[0, 0] = data
        request = InferRequest(self.steps[0], "1", {"TEXT": text})
        outputs = _only(self.tokenizer.execute([request])).outputs
        return {name: array[0] for name, array in outputs.items()}

    def stack(self, items: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Each input [B, L] (the same text: the same length)."""
        return {name: np.stack([item[name] for item in items]) for name in items[0]}

    def second(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Token ids -> last_hidden_state [B, L, 384], with the mask for pooling."""
        hidden = self.session.run(batch)["last_hidden_state"]
        return {"TOKEN_EMBEDDINGS": hidden, "ATTENTION_MASK": batch["attention_mask"]}

    def third(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """Mean pooling over the mask, L2-normalised: [B, 384]."""
        request = InferRequest(self.steps[2], "1", outputs)
        embedding: np.ndarray = _only(self.pool.execute([request])).outputs["EMBEDDING"]
        return embedding

    def describe(self, answer: np.ndarray) -> str:
        """Width and norm of the first embedding."""
        return f"embedding [{answer.shape[-1]}], norm {float(np.linalg.norm(answer[0])):.3f}"


FLOORS: dict[str, type[ImageFloor] | type[TextFloor]] = {
    "image_classifier": ImageFloor,
    "text_embedding": TextFloor,
}
"""Ensemble -> the floor of its steps."""
