"""Chat (whole and streamed), completions, models and embeddings via the openai SDK.

argv: base_url (JSON string). Prints one JSON summary line.
"""

import json
import sys

import openai

base_url = json.loads(sys.argv[1])
client = openai.OpenAI(base_url=base_url, api_key="any-key", max_retries=0)
question = [{"role": "user", "content": "What is the capital of France?"}]

chat = client.chat.completions.create(model="llm", messages=question, temperature=0, max_tokens=32)

chunks = [
    chunk.model_dump()
    for chunk in client.chat.completions.create(
        model="llm",
        messages=question,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
]

parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
parts_chat = client.chat.completions.create(
    model="llm", messages=[{"role": "user", "content": parts}], temperature=0, max_tokens=32
)

completion = client.completions.create(
    model="llm", prompt="The capital of France is", temperature=0, max_tokens=8
)
text_chunks = [
    chunk.model_dump()
    for chunk in client.completions.create(
        model="llm", prompt="The capital of France is", temperature=0, max_tokens=8, stream=True
    )
]

texts = ["A man is playing a guitar.", "Someone plays an acoustic guitar."]
floats = client.embeddings.create(model="text_embedding", input=texts, encoding_format="float")
# The SDK asks for base64 by default and decodes it.
default = client.embeddings.create(model="text_embedding", input=texts)

print(
    json.dumps(
        {
            "chat": chat.model_dump(),
            "chunks": chunks,
            "parts_chat": parts_chat.model_dump(),
            "completion": completion.model_dump(),
            "text_chunks": text_chunks,
            "models": [m.model_dump() for m in client.models.list()],
            "embeddings": floats.model_dump(),
            "embeddings_base64": default.model_dump(),
        }
    )
)
