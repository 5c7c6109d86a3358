"""Bad requests through the openai SDK: each one's exception class, status and body.

argv: base_url. Prints {case: {"class", "status", "body"}}.
"""

import json
import sys
from typing import Any

import openai

base_url = json.loads(sys.argv[1])
client = openai.OpenAI(base_url=base_url, api_key="any-key", max_retries=0)
question = [{"role": "user", "content": "What is the capital of France?"}]
# Far past the model's 2048-token context.
too_long = [{"role": "user", "content": "the capital of France " * 1200}]

cases: dict[str, Any] = {
    "negative_max_tokens": lambda: client.chat.completions.create(
        model="llm", messages=question, max_tokens=-1
    ),
    "unknown_model": lambda: client.chat.completions.create(model="ghost", messages=question),
    "too_long": lambda: client.chat.completions.create(
        model="llm", messages=too_long, max_tokens=4
    ),
    "too_long_stream": lambda: list(
        client.chat.completions.create(model="llm", messages=too_long, max_tokens=4, stream=True)
    ),
    "malformed_messages": lambda: client.chat.completions.create(
        model="llm", messages=[{"role": "wizard", "content": "hi"}]
    ),
    "suffix": lambda: client.completions.create(model="llm", prompt="Hi", suffix="!"),
    "too_many_top_logprobs": lambda: client.chat.completions.create(
        model="llm", messages=question, logprobs=True, top_logprobs=21
    ),
    "token_prompt": lambda: client.completions.create(model="llm", prompt=[1, 2, 3]),
    "token_embeddings": lambda: client.embeddings.create(model="text_embedding", input=[[1, 2]]),
    "unknown_embedder": lambda: client.embeddings.create(model="ghost", input="hello"),
}
results = {}
for name, call in cases.items():
    try:
        call()
        results[name] = {"class": None}
    except openai.APIStatusError as exc:
        results[name] = {"class": type(exc).__name__, "status": exc.status_code, "body": exc.body}
print(json.dumps(results))
