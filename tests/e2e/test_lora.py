"""LoRA adapters and prefix caching on the session's vLLM engine, through Envoy.

The session repository (lora_repository.py) runs smollm2 with LoRA on and
holds the adapter models/smollm2_lora.py trained at preparation. The
reference answer is transformers + peft's greedy decoding of the same adapter
on the same prompt, in float32 as the engine serves.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from models import smollm2_lora
from tests.e2e.conftest import llm_metrics, post

pytestmark = pytest.mark.e2e

ADAPTER = smollm2_lora.ADAPTER_NAME
PROMPT = "What is the largest ocean on Earth?"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(mesh: dict[str, Any]) -> openai.OpenAI:
    base = f"http://{mesh['processes']['envoy']['grpc']}/v1"
    return openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)


def _answer(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    return reply.choices[0].message.content or ""


def _peft_answer(prepared: Path) -> str:
    """Greedy text of base + adapter by transformers and peft (no vLLM)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base_dir = prepared / smollm2_lora.BASE_MODEL / "1"
    adapter_dir = prepared.parent / smollm2_lora.ADAPTERS_FOLDER / ADAPTER / "1"
    tokenizer: Any = AutoTokenizer.from_pretrained(str(base_dir))
    base: Any = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model: Any = PeftModel.from_pretrained(base, str(adapter_dir))
    ids = smollm2_lora.greedy(model.eval(), tokenizer, PROMPT, MAX_TOKENS)
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def _pid(mesh: dict[str, Any]) -> int:
    pid: int = mesh["processes"]["inference-0"]["pid"]
    return pid


def test_adapter_loaded_and_unloaded_at_run_time_as_peft_predicts(
    mesh: dict[str, Any], client: openai.OpenAI, prepared_repository: Path
) -> None:
    envoy = f"http://{mesh['processes']['envoy']['grpc']}"
    pid = _pid(mesh)
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert listed[ADAPTER].get("parent") == "llm", listed

    expected = _peft_answer(prepared_repository)
    base_answer = _answer(client, "llm")
    assert expected.strip() == smollm2_lora.ADAPTER_ANSWER
    assert _answer(client, ADAPTER) == expected
    assert base_answer != expected

    status, _, body = post(f"{envoy}/v1/unload_lora_adapter", {"lora_name": ADAPTER})
    assert status == 200 and b"removed" in body, body
    with pytest.raises(openai.APIStatusError) as refused:
        _answer(client, ADAPTER)
    assert refused.value.status_code in (400, 404, 503), refused.value
    assert _answer(client, "llm") == base_answer
    assert ADAPTER not in {m.id for m in client.models.list().data}

    # Back by the v2 repository API: the same engine takes it again.
    status, _, body = post(f"{envoy}/v2/repository/models/{ADAPTER}/load", {})
    assert status == 200, body
    assert _answer(client, ADAPTER) == expected
    assert _pid(mesh) == pid  # no restart
    with_path = {"lora_name": ADAPTER, "lora_path": "/elsewhere"}
    status, _, body = post(f"{envoy}/v1/load_lora_adapter", with_path)
    assert status == 400 and json.loads(body)["error"]["param"] == "lora_path", body


def test_prefix_cache_hits_in_metrics(mesh: dict[str, Any], client: openai.OpenAI) -> None:
    metrics_port = mesh["processes"]["inference-0"]["metrics_port"]
    before = llm_metrics(metrics_port)
    # vLLM caches whole blocks (128 tokens on CPU, 16 on CUDA): the chat template's
    # system prompt and this long question fill at least one, which the second
    # request finds cached.
    question = "Describe, in one short sentence, " + "the colour of the sky at noon " * 30
    for _ in range(2):
        client.chat.completions.create(
            model="llm",
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=1,
        )
    after = llm_metrics(metrics_port)
    queries = "meshserve_llm_prefix_cache_queries_total"
    hits = "meshserve_llm_prefix_cache_hits_total"
    assert after[queries] - before.get(queries, 0.0) >= 2 * 128
    assert after[hits] - before.get(hits, 0.0) >= 128
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "vllm:prefix_cache_hits_total" in text  # vLLM's own series, relayed
