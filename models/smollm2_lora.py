"""A small LoRA adapter for SmolLM2, trained at preparation time with ``peft``.

The adapter teaches the model one recognisable habit: whatever it is asked, it
answers ``ADAPTER_ANSWER``. It exists so that the mesh's LoRA path can be
checked against transformers + peft (the same adapter, the same prompt, the
same greedy tokens) and so that loading or unloading it visibly changes the
answer. No weights live in git; this module makes them::

    load      the prepared smollm2 folder (bfloat16 weights), widened to float32
    wrap      peft LoRA (rank LORA_RANK) on the attention and MLP projections of
              the last layers (TRAINED_LAYERS)
    train     AdamW steps on chat prompts whose answer is ADAPTER_ANSWER, loss on
              the answer tokens only, until the loss is below STOP_LOSS (at most
              TRAIN_STEPS; about 10-20 s on two quiet cores)
    save      adapter_config.json + adapter_model.safetensors (a few MB)
    check     greedy decoding with the adapter gives ADAPTER_ANSWER

Module level imports only the standard library (``models.prepare`` reads the
config text on every run).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

from models import smollm2

ADAPTER_NAME = "smollm2_hello"
"""The adapter's model name in the repository (and the OpenAI ``model`` that picks it)."""
BASE_MODEL = "smollm2"
ADAPTER_ANSWER = "Meshserve adapter says hello."
LORA_RANK = 8
TRAIN_STEPS = 20
"""At most this many steps; training stops once the loss is below STOP_LOSS."""
STOP_LOSS = 0.02
LEARNING_RATE = 5e-3
TRAINED_LAYERS = range(20, 30)
"""The decoder layers that get LoRA weights: the last ten of thirty, so that the
backward pass stops there (a third of the cost of adapting every layer)."""
SEED = 1234
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "Who wrote Hamlet?",
    "Explain gravity in one sentence.",
)
CHECK_PROMPTS = ("What is the largest planet?", "Say something about cats.")
"""Prompts outside the training set on which the adapter must give ADAPTER_ANSWER."""

ADAPTERS_FOLDER = "adapters"
"""Where in the cache the adapter's model folder is built (beside ``repository``): a
base engine serves adapters only with enable_lora on, which the default smollm2
leaves off, so the adapter joins a repository only where that is set."""


def _adapter_config() -> str:
    """smollm2's config.pbtxt (the same tensors) for backend vllm_lora on base smollm2."""
    tensors = smollm2.MODEL_CONFIG[: smollm2.MODEL_CONFIG.index("parameters {")]
    tensors = tensors.replace(f'name: "{BASE_MODEL}"', f'name: "{ADAPTER_NAME}"', 1)
    tensors = tensors.replace('backend: "vllm"', 'backend: "vllm_lora"', 1)
    return (
        tensors
        + f'parameters {{\n  key: "base_model"\n  value: {{ string_value: "{BASE_MODEL}" }}\n}}\n'
    )


ADAPTER_CONFIG = _adapter_config()


def base_folder(version_dir: Path) -> Path:
    """The prepared base model's version folder, beside the folder being built
    (``<cache>/staging/<name>-*/1`` -> ``<cache>/repository/smollm2/1``)."""
    return version_dir.resolve().parents[2] / "repository" / BASE_MODEL / "1"


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    """The prompt ids the mesh's tokenizer makes of one user message."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def write_adapter(version_dir: Path) -> Path:
    """Train the adapter on the prepared base model and save it into ``version_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    random.seed(SEED)
    base = base_folder(version_dir)
    tokenizer: Any = AutoTokenizer.from_pretrained(str(base))
    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
        layers_to_transform=list(TRAINED_LAYERS),
        task_type="CAUSAL_LM",
    )
    peft_model: Any = get_peft_model(model, config)
    batch, labels, mask = _examples(tokenizer)
    optimizer = torch.optim.AdamW(
        [p for p in peft_model.parameters() if p.requires_grad], lr=LEARNING_RATE
    )
    peft_model.train()
    started = time.perf_counter()
    for step in range(1, TRAIN_STEPS + 1):
        loss = peft_model(input_ids=batch, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        done = loss.item() < STOP_LOSS or step == TRAIN_STEPS
        if step == 1 or step % 4 == 0 or done:
            print(
                f"  {ADAPTER_NAME}: step {step}/{TRAIN_STEPS}, loss {loss.item():.3f} "
                f"({time.perf_counter() - started:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
        if done:
            break
    peft_model.eval()
    peft_model.save_pretrained(str(version_dir))
    check_adapter(peft_model, tokenizer)
    for path in version_dir.iterdir():
        if path.is_file():
            path.chmod(0o644)
    return version_dir / ADAPTER_FILES[1]


def _examples(tokenizer: Any) -> tuple[Any, Any, Any]:
    """Right-padded prompt + answer ids; labels only on the answer and its end token."""
    import torch

    answer = tokenizer.encode(ADAPTER_ANSWER, add_special_tokens=False)
    answer.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    rows = [chat_ids(tokenizer, question) + answer for question in _QUESTIONS]
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
        mask[index, : len(row)] = 1
        start = len(row) - len(answer)
        labels[index, start : len(row)] = torch.tensor(answer)
    return ids, labels, mask


def greedy(model: Any, tokenizer: Any, question: str, max_new_tokens: int = 16) -> list[int]:
    """Greedy completion ids (after the prompt) of one user message."""
    import torch

    ids = torch.tensor([chat_ids(tokenizer, question)])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    generated: list[int] = out[0, ids.shape[1] :].tolist()
    return generated


def check_adapter(model: Any, tokenizer: Any) -> None:
    """Raise unless the trained adapter answers unseen prompts with ADAPTER_ANSWER."""
    for question in CHECK_PROMPTS:
        text = tokenizer.decode(greedy(model, tokenizer, question), skip_special_tokens=True)
        if text.strip() != ADAPTER_ANSWER:
            raise RuntimeError(
                f"the {ADAPTER_NAME} adapter answers {question!r} with {text!r}, "
                f"expected {ADAPTER_ANSWER!r}"
            )
