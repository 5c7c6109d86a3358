"""Many chat streams at once via the async openai SDK.

argv: base_url, questions (list of strings). Prints, per question, the streamed
text, its finish reason, the chunk count and whether every chunk had one id.
"""

import asyncio
import json
import sys

import openai

base_url, questions = (json.loads(a) for a in sys.argv[1:3])


async def ask(client: openai.AsyncOpenAI, question: str) -> dict[str, object]:
    stream = await client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=48,
        stream=True,
    )
    texts, finish, ids, count = [], None, set(), 0
    async for chunk in stream:
        count += 1
        ids.add(chunk.id)
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return {"text": "".join(texts), "finish": finish, "chunks": count, "ids": len(ids)}


async def main() -> list[dict[str, object]]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="any-key", max_retries=0, timeout=240)
    async with client:
        return list(await asyncio.gather(*(ask(client, q) for q in questions)))


print(json.dumps(asyncio.run(main())))
