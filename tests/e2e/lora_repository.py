"""The e2e session's repository: the prepared one, smollm2 with LoRA on, and its adapter.

The default smollm2 leaves LoRA off (the engine runs a little more per token
with it on, and the LLM benchmark compares it with a plain ``vllm serve``);
the session mesh turns it on so that tests/e2e/test_lora.py uses the one
session engine instead of a second one. Every other model is a link to the
prepared folder; smollm2's version folder is linked too, only its
config.pbtxt differs.
"""

from __future__ import annotations

from pathlib import Path

from models import smollm2_lora

LORA_PARAMETERS = {"enable_lora": "true", "max_loras": "1", "max_lora_rank": "8"}


def lora_config(base_config: str) -> str:
    """``base_config`` (a config.pbtxt text) with LORA_PARAMETERS added."""
    extra = "".join(
        f'parameters {{\n  key: "{key}"\n  value: {{ string_value: "{value}" }}\n}}\n'
        for key, value in LORA_PARAMETERS.items()
    )
    return base_config + extra


def with_adapters(prepared: Path, folder: Path) -> Path:
    """A repository in ``folder``: ``prepared``'s models, the base with LoRA on, and
    the adapters prepared beside ``prepared`` (``<cache>/adapters``)."""
    repository = folder / "repository"
    repository.mkdir()
    base = smollm2_lora.BASE_MODEL
    for model in prepared.iterdir():
        if model.is_dir() and model.name != base:
            (repository / model.name).symlink_to(model, target_is_directory=True)
    (repository / base).mkdir()
    text = (prepared / base / "config.pbtxt").read_text(encoding="utf-8")
    (repository / base / "config.pbtxt").write_text(lora_config(text), encoding="utf-8")
    (repository / base / "1").symlink_to(prepared / base / "1", target_is_directory=True)
    for adapter in (prepared.parent / smollm2_lora.ADAPTERS_FOLDER).iterdir():
        (repository / adapter.name).symlink_to(adapter, target_is_directory=True)
    return repository
