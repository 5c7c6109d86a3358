"""The postprocess stage: model outputs -> what a caller wants to read.

Backends, one module each (no gRPC imports; ``main`` registers them):

- ``classify`` (``classify.py``): LOGITS -> softmax -> top-k LABELS and PROBABILITIES.
- ``embedding_pool`` (``pool.py``): token embeddings -> masked mean -> L2-normalised EMBEDDING.
- ``detokenize`` (to come, ``detokenize.py``): LLM token ids -> text, incrementally for
  ``ModelStreamInfer`` streams (a decoupled model: several responses per request,
  ``InferResponse.final`` on the last). Register it in ``main.backends()``; the
  repository already routes ``backend: "detokenize"`` models to this service.
"""
