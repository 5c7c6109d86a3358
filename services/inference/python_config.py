"""A python model's config as the model sees it: a dict, and ``auto_complete_config``.

Triton hands ``initialize`` the config as JSON with every field present and
numbers as numbers (``dims: [4]``, not ``["4"]``), and lets a model's static
``auto_complete_config`` fill in what a minimal (or missing) ``config.pbtxt``
leaves out: ``max_batch_size``, inputs, outputs, dynamic batching and the
transaction policy, through the ``ModelConfig`` object below.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from inference import model_config_pb2 as mc
from shared.errors import ConfigError
from shared.protojson import to_json

_INPUT_KEYS = ("name", "data_type", "dims", "optional")
_OUTPUT_KEYS = ("name", "data_type", "dims")


def model_config_dict(config: mc.ModelConfig) -> dict[str, Any]:
    """The config as Triton's JSON document (all fields, numbers as numbers)."""
    return to_json(config)


class ModelConfig:
    """The config ``auto_complete_config`` may extend (Triton's ``pb_utils.ModelConfig``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config

    @property
    def _name(self) -> str:
        return str(self._config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        """The config as it stands (read it; change it through the setters)."""
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """The model's largest batch; a config that asked for more is an error."""
        configured = int(self._config.get("max_batch_size", 0))
        if configured > max_batch_size:
            raise ValueError(
                f"model '{self._name}': the configuration asks for max_batch_size "
                f"{configured}, but auto_complete_config allows at most {max_batch_size}"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        """Batch requests dynamically (unless the config already chose how)."""
        for other in ("sequence_batching", "ensemble_scheduling"):
            if self._config.get(other):
                raise ValueError(
                    f"model '{self._name}': the configuration sets {other}; "
                    "auto_complete_config cannot set dynamic_batching"
                )
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, policy: dict[str, Any]) -> None:
        """Set ``{"decoupled": bool}``; a config that said otherwise is an error."""
        unknown = sorted(set(policy) - {"decoupled"})
        if unknown:
            raise ValueError(f"model '{self._name}': unknown transaction policy keys {unknown}")
        current = self._config.get("model_transaction_policy", {}).get("decoupled", False)
        wanted = bool(policy.get("decoupled", False))
        if current and not wanted:
            raise ValueError(
                f"model '{self._name}': the configuration is decoupled, "
                "auto_complete_config asks for decoupled: false"
            )
        self._config["model_transaction_policy"] = {"decoupled": wanted}

    def add_input(self, tensor: dict[str, Any]) -> None:
        """Declare an input (name, data_type, dims, optional); a configured one must agree."""
        self._add("input", tensor, _INPUT_KEYS)

    def add_output(self, tensor: dict[str, Any]) -> None:
        """Declare an output (name, data_type, dims); a configured one must agree."""
        self._add("output", tensor, _OUTPUT_KEYS)

    def _add(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        name = tensor.get("name")
        extra = sorted(set(tensor) - set(allowed))
        if extra:
            raise ValueError(
                f"model '{self._name}': {kind} '{name}' has keys {extra}; allowed: {list(allowed)}"
            )
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"model '{self._name}': {kind} '{name}' has no '{key}'")
        tensors = self._config.setdefault(kind, [])
        existing = next((t for t in tensors if t.get("name") == name), None)
        if existing is None:
            tensors.append(dict(tensor))
            return
        for key in ("data_type", "dims", "optional"):
            configured = existing.get(key)
            unset = configured in (None, [], "TYPE_INVALID", False)
            if key in tensor and not unset and configured != tensor[key]:
                raise ValueError(
                    f"model '{self._name}': {kind} '{name}': the configuration says {key} "
                    f"{configured}, the model says {tensor[key]}"
                )
        existing.update(tensor)


def completed_config(config: mc.ModelConfig, model_class: Any) -> mc.ModelConfig:
    """The config after the model class's ``auto_complete_config`` (if it has one)."""
    hook = getattr(model_class, "auto_complete_config", None)
    if hook is None:
        return config
    document = model_config_dict(config)
    try:
        returned = hook(ModelConfig(document))
    except Exception as exc:
        raise ConfigError(f"model '{config.name}': auto_complete_config failed: {exc}") from exc
    if isinstance(returned, ModelConfig):
        document = returned.as_dict()
    completed = mc.ModelConfig()
    try:
        json_format.ParseDict(document, completed)
    except json_format.ParseError as exc:
        raise ConfigError(
            f"model '{config.name}': auto_complete_config made an invalid config: {exc}"
        ) from exc
    return completed
