"""Open a long chat stream, read a few chunks, then close the connection.

argv: base_url, chunks to read. Prints how many were read.
"""

import json
import sys

import openai

base_url, wanted = (json.loads(a) for a in sys.argv[1:3])
client = openai.OpenAI(base_url=base_url, api_key="any-key", max_retries=0)
stream = client.chat.completions.create(
    model="llm",
    messages=[{"role": "user", "content": "Write a long story about a dragon and a knight."}],
    max_tokens=1500,
    temperature=0.8,
    stream=True,
    extra_body={"ignore_eos": True},  # only the abort can end it, never an early end of text
)
read = 0
finish = None
for chunk in stream:
    read += 1
    finish = chunk.choices[0].finish_reason if chunk.choices else finish
    if read >= wanted:
        break
stream.close()
client.close()
print(json.dumps({"read": read, "finish": finish}))
