"""The HTTP adapter: KServe v2 REST and the OpenAI-compatible API, in front of the orchestrator.

The request path, one module each::

    app.py        aiohttp routes (thin), composed with...
      middleware.py  one middleware per concern: metrics, span, error map, drain gate
      |
    rest.py       inference: JSON tensors / binary extension <-> ModelInferRequest
      json_tensors.py   JSON ``data`` <-> raw little-endian bytes, checked per datatype
    documents.py  everything else: v2 protos <-> the spec's JSON documents
    generate.py   Triton's generate extension over a pipeline's ModelStreamInfer
    openai.py     /v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings
      openai_documents.py  OpenAI JSON <-> meshserve.v1 Chat/Generate/Embed (pure)
    sse.py        the one SSE writer and the one pump from a gRPC stream into it
      |
    upstream.py   the orchestrator's typed v2 and meshserve.v1 calls over a pool of channels
      core_upstream.py  the same v2 calls answered by the orchestrator's core in process

``front_door.py`` holds the settings both hosts share, the listener and its drain;
``main.py`` runs the app as a process of its own over gRPC:
``python -m gateway.http.main --orchestrator 127.0.0.1:8001 --http-port 8007``;
``in_orchestrator.py`` runs it inside the orchestrator, over its core
(docs/http-front-door.md).
"""
