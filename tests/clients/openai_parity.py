"""vLLM's OpenAI options through the openai SDK: n with a seed, logprobs, structured
output, tools. The same script runs against the mesh and against ``vllm serve``
(loadtests/peer_openai.py compares the two).

argv: base_url (JSON string), model (JSON string, optional: "llm"). Prints one
JSON object of the answers, as the SDK parsed them.
"""

import concurrent.futures
import json
import sys
from typing import Any

import openai

base_url = json.loads(sys.argv[1])
model = json.loads(sys.argv[2]) if len(sys.argv) > 2 else "llm"
client = openai.OpenAI(base_url=base_url, api_key="any-key", max_retries=0, timeout=240)
question = [{"role": "user", "content": "What is the capital of France?"}]
COUNTRIES = [
    "France", "Japan", "Italy", "Germany", "Spain", "Egypt", "Canada", "Peru", "Kenya", "China",
    "Greece", "Norway", "Poland", "Sweden", "Chile", "India", "Brazil", "Mexico", "Ireland", "Cuba",
]  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "enum": COUNTRIES},
        "capital": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
        "continent": {
            "type": "string",
            "enum": ["Africa", "America", "Asia", "Europe", "Oceania"],
        },
    },
    "required": ["country", "capital", "continent"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def seeded() -> list[str]:
    answer = client.chat.completions.create(
        model=model, messages=question, n=3, temperature=1.0, seed=1234, max_tokens=24
    )
    return [c.message.content or "" for c in sorted(answer.choices, key=lambda c: c.index)]


def streamed_choices() -> dict[str, Any]:
    chunks = list(
        client.completions.create(
            model=model,
            prompt="The capital of France is",
            n=2,
            temperature=1.0,
            seed=5,
            max_tokens=8,
            echo=True,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    usage = [c.usage.model_dump() if c.usage else None for c in chunks]
    return {"texts": texts, "finishes": finishes, "usage": usage}


def logprobs() -> dict[str, Any]:
    chat = client.chat.completions.create(
        model=model, messages=question, temperature=0, max_tokens=12, logprobs=True, top_logprobs=5
    )
    completion = client.completions.create(
        model=model, prompt="The capital of France is", temperature=0, max_tokens=6, logprobs=3
    )
    stream = [
        c.model_dump()
        for c in client.chat.completions.create(
            model=model,
            messages=question,
            temperature=0,
            max_tokens=12,
            logprobs=True,
            top_logprobs=5,
            stream=True,
        )
    ]
    return {
        "chat": chat.model_dump(),
        "completion": completion.model_dump(),
        "chat_chunks": stream,
    }


def structured(country: str) -> str:
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Describe {country} as JSON."}],
        temperature=0.7,
        seed=3,
        max_tokens=80,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "country", "schema": SCHEMA, "strict": True},
        },
    )
    return answer.choices[0].message.content or ""


def extras() -> dict[str, Any]:
    def one(**extra: Any) -> str:
        answer = client.chat.completions.create(
            model=model, messages=question, temperature=0, max_tokens=12, extra_body=extra
        )
        return answer.choices[0].message.content or ""

    return {
        "choice": one(structured_outputs={"choice": ["Paris", "Lyon", "Nice"]}),
        "regex": one(structured_outputs={"regex": "[0-9]{3}"}),
        "json_object": client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Give a JSON object about Paris."}],
            temperature=0,
            max_tokens=40,
            response_format={"type": "json_object"},
        )
        .choices[0]
        .message.content,
    }


def refused(call: Any) -> dict[str, Any]:
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "choices"):
            result = [c.model_dump() for c in result]
        return {"class": None, "result": str(result)[:500]}
    except openai.APIStatusError as exc:
        return {"class": type(exc).__name__, "status": exc.status_code, "body": exc.body}


def tools() -> dict[str, Any]:
    def call(stream: bool) -> Any:
        return client.chat.completions.create(
            model=model, messages=question, tools=TOOLS, tool_choice="auto", stream=stream
        )

    return {"whole": refused(lambda: call(False)), "stream": refused(lambda: call(True))}


with concurrent.futures.ThreadPoolExecutor(20) as pool:
    schema_answers = list(pool.map(structured, COUNTRIES))
print(
    json.dumps(
        {
            "seeded": [seeded(), seeded()],
            "streamed_choices": streamed_choices(),
            "logprobs": logprobs(),
            "schema": SCHEMA,
            "schema_answers": schema_answers,
            "extras": extras(),
            "tools": tools(),
        }
    )
)
