"""The model repository: Triton's ``<repo>/<model>/config.pbtxt`` + version folders.

``config.pbtxt`` is parsed with protobuf ``text_format`` into Triton's
``ModelConfig`` schema, so any real Triton config parses; fields the mesh does
not implement are reported by name instead of being silently ignored. A bad
file gives an error naming the file, the line and what is wrong; the file as
a path in the repository (``model/config.pbtxt``), since errors reach callers
who have no business knowing the server's folders.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format

from inference import model_config_pb2 as mc
from shared.errors import ConfigError, NotFound

log = logging.getLogger(__name__)

CONFIG_FILE = "config.pbtxt"
AUTO_COMPLETE_FILE = "model.py"
AUTO_COMPLETE_BACKEND = "python"
"""A model folder without config.pbtxt whose version holds ``model.py`` is served
by this backend (Triton picks it by the file, then asks the model to complete it)."""

# Top-level ModelConfig fields the mesh implements; anything else that is set
# is reported as unsupported (parsed, kept, but without effect).
SUPPORTED_FIELDS = frozenset(
    {
        "name",
        "platform",
        "backend",
        "runtime",
        "version_policy",
        "max_batch_size",
        "input",
        "output",
        "batch_input",
        "batch_output",
        "instance_group",
        "default_model_filename",
        "dynamic_batching",
        "ensemble_scheduling",
        "parameters",
        "model_warmup",
        "model_transaction_policy",
        "label_filename",
    }
)


@dataclass(frozen=True)
class ModelEntry:
    """One model folder: its parsed config and the versions on disk."""

    name: str
    path: Path
    config: mc.ModelConfig
    versions_on_disk: tuple[int, ...]

    def selected_versions(self) -> tuple[int, ...]:
        """The versions the config's version_policy serves (ascending)."""
        return select_versions(self.config, self.versions_on_disk, self.path)

    def version_path(self, version: int) -> Path:
        """The folder of one version."""
        return self.path / str(version)


def shown(path: Path) -> str:
    """A model's file as errors name it: relative to the repository (``model/file``)."""
    return f"{path.parent.name}/{path.name}"


# An absolute path in an error's text: a caller sees only its last part.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])(?:/[\w.@+~-]+)+/([\w.@+~-]+)")


def safe_text(text: str, root: Path | None) -> str:
    """An error's text fit for any caller: paths in the repository ``root`` as
    paths in it (``model/1/model.onnx``), any other absolute path cut to its
    last part. (The log keeps the full text.)"""
    if root is not None:
        for folder in {str(root.absolute()), str(root.resolve())}:
            text = text.replace(folder + "/", "")
    return _ABSOLUTE_PATH.sub(r".../\1", text)


def read_config(path: Path) -> str:
    """The text of one config.pbtxt."""
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"{shown(path)}: cannot read: {exc.strerror}") from exc


def parse_config(path: Path, text: str | None = None) -> mc.ModelConfig:
    """Parse one config.pbtxt (``text``: its text, if read already); errors name the
    file, line and column."""
    if text is None:
        text = read_config(path)
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        line, column = exc.GetLine(), exc.GetColumn()
        where = f"{shown(path)}:{line}:{column}" if line else shown(path)
        message = str(exc).split(" : ", 1)[-1] if line else str(exc)
        raise ConfigError(f"{where}: {message}") from exc
    return config


def unsupported_fields(config: mc.ModelConfig) -> list[str]:
    """Names of set top-level fields that the mesh parses but does not act on."""
    return sorted(
        field.name for field, _ in config.ListFields() if field.name not in SUPPORTED_FIELDS
    )


def validate_config(config: mc.ModelConfig, path: Path) -> None:
    """Checks that text_format cannot make: names, batch size, types, dims."""
    where = shown(path)
    if config.max_batch_size < 0:
        raise ConfigError(f"{where}: max_batch_size must be >= 0, got {config.max_batch_size}")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for tensor in tensors:
            if not tensor.name:
                raise ConfigError(f"{where}: an {kind} has no name")
            if tensor.name in seen:
                raise ConfigError(f"{where}: {kind} '{tensor.name}' is declared twice")
            seen.add(tensor.name)
            if tensor.data_type == mc.TYPE_INVALID:
                raise ConfigError(f"{where}: {kind} '{tensor.name}' has no data_type")
            if any(dim < -1 or dim == 0 for dim in tensor.dims):
                raise ConfigError(
                    f"{where}: {kind} '{tensor.name}' dims {list(tensor.dims)}: each must be "
                    "positive or -1 (variable)"
                )
    if not (config.backend or config.platform):
        raise ConfigError(f"{where}: neither backend nor platform is set")


def select_versions(
    config: mc.ModelConfig, on_disk: tuple[int, ...], path: Path
) -> tuple[int, ...]:
    """Apply version_policy (default: latest 1) to the versions on disk."""
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if config.platform == "ensemble" or config.backend == "ensemble":
        return on_disk or (1,)
    if which == "all":
        chosen = on_disk
    elif which == "specific":
        missing = sorted(set(policy.specific.versions) - set(on_disk))
        if missing:
            raise ConfigError(
                f"{shown(path / CONFIG_FILE)}: version_policy.specific names versions {missing} "
                f"that have no folder (on disk: {list(on_disk)})"
            )
        chosen = tuple(sorted(policy.specific.versions))
    else:
        count = policy.latest.num_versions if which == "latest" else 1
        if count < 1:
            raise ConfigError(
                f"{shown(path / CONFIG_FILE)}: version_policy.latest.num_versions must be >= 1"
            )
        chosen = on_disk[-count:]
    if not chosen:
        raise ConfigError(f"{path.name}: no numbered version folder to serve")
    return chosen


class ModelRepository:
    """Reads a model repository folder; re-reads on every call (it may change).

    A config.pbtxt is parsed again only when its text changed: RepositoryIndex
    lists every model every few seconds (the orchestrator's discovery), and
    parsing all of them each time kept every idle stage at ~1% of a core.
    (The text, not the file's mtime: a config rewritten within one timestamp
    tick must not be missed.)
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._configs: dict[Path, tuple[str, mc.ModelConfig]] = {}

    def names(self) -> list[str]:
        """Model folder names: those with a config.pbtxt, and python models without one."""
        if not self.root.is_dir():
            log.error("model repository folder %s does not exist", self.root)
            raise ConfigError("the model repository folder does not exist")
        return sorted(child.name for child in self.root.iterdir() if self.has(child.name))

    def has(self, name: str) -> bool:
        """True when ``name`` is a model folder of the repository."""
        folder = self.root / name
        return (folder / CONFIG_FILE).is_file() or _python_model_without_config(folder)

    def _text(self, name: str, config_path: Path) -> str:
        """The config's text; a python model without one gets Triton's minimal config
        (its ``auto_complete_config`` fills in the rest at load)."""
        if not config_path.is_file() and _python_model_without_config(config_path.parent):
            return f'backend: "{AUTO_COMPLETE_BACKEND}"\n'
        return read_config(config_path)

    def entry(self, name: str) -> ModelEntry:
        """The parsed, validated entry of one model."""
        path = self.root / name
        config_path = path / CONFIG_FILE
        if not self.has(name):
            raise NotFound(f"model '{name}' is not in the model repository")
        config = mc.ModelConfig()
        config.CopyFrom(self._config(name, config_path))  # callers may change their copy
        versions = tuple(
            sorted(
                int(child.name)
                for child in path.iterdir()
                if child.is_dir() and child.name.isdigit()
            )
        )
        return ModelEntry(name=name, path=path, config=config, versions_on_disk=versions)

    def config(self, name: str) -> mc.ModelConfig:
        """The parsed config of a model named by ``names()``, shared: do not change it.

        For a look over every model (RepositoryIndex, every few seconds):
        no copy, no listing of version folders.
        """
        return self._config(name, self.root / name / CONFIG_FILE)

    def _config(self, name: str, config_path: Path) -> mc.ModelConfig:
        """The parsed, validated config; from the cache while the file is unchanged."""
        text = self._text(name, config_path)
        cached = self._configs.get(config_path)
        if cached is not None and cached[0] == text:
            return cached[1]
        config = parse_config(config_path, text)
        if config.name and config.name != name:
            raise ConfigError(
                f"{shown(config_path)}: name '{config.name}' differs from its folder name '{name}'"
            )
        config.name = name
        validate_config(config, config_path)
        for field in unsupported_fields(config):
            log.warning(
                "%s: field '%s' is parsed but not supported; it has no effect", config_path, field
            )
        self._configs[config_path] = (text, config)
        return config

    def entries(self) -> list[ModelEntry]:
        """Every model's entry (raises on the first bad config)."""
        return [self.entry(name) for name in self.names()]

    def declared_backend(self, name: str) -> str | None:
        """The backend (or platform) a model's config names even when the config
        is invalid; None when its text does not parse. (Which stage owns a broken
        model, so that it alone shows the error.)"""
        config_path = self.root / name / CONFIG_FILE
        try:
            config = parse_config(config_path, self._text(name, config_path))
        except ConfigError:
            return None
        return config.backend or config.platform or None


def _python_model_without_config(folder: Path) -> bool:
    """A model folder with no config.pbtxt whose version folder holds a model.py
    (Triton serves it with the python backend and the model's auto-complete)."""
    if not folder.is_dir() or (folder / CONFIG_FILE).exists():
        return False
    return any(
        child.is_dir() and child.name.isdigit() and (child / AUTO_COMPLETE_FILE).is_file()
        for child in folder.iterdir()
    )


def is_ensemble(config: mc.ModelConfig) -> bool:
    """True for ``platform: "ensemble"`` models, which the orchestrator hosts. Every
    other model is hosted by the stage whose backends run it; each stage lists
    those in its RepositoryIndex, which is how the orchestrator finds them."""
    return config.platform == "ensemble" or config.backend == "ensemble"
