"""The postprocess stage: model outputs -> what a caller wants to read.

Backends, one module each (no gRPC imports; ``main`` registers them):

- ``classify`` (``classify.py``): LOGITS -> softmax -> top-k LABELS and PROBABILITIES.
- ``embedding_pool`` (``pool.py``): token embeddings -> masked mean -> L2-normalised EMBEDDING.
- ``detokenize`` (``detokenize.py``): cumulative LLM token ids -> the new text since the
  last response, correct across multi-byte characters and merged tokens, with stop
  strings; stateless, so it runs once per streamed response of the ``llm`` ensemble.
"""
