"""KServe v2 REST (the Open Inference Protocol over HTTP) in front of the orchestrator.

The request path, one module each::

    app.py        aiohttp routes, errors, tracing, draining (thin)
      |
    rest.py       inference: JSON tensors / binary extension <-> ModelInferRequest
      json_tensors.py   JSON ``data`` <-> raw little-endian bytes, checked per datatype
    documents.py  everything else: v2 protos <-> the spec's JSON documents
      |
    upstream.py   the orchestrator over a small pool of grpc.aio channels

``main.py`` holds the config and ``serve``:
``python -m gateway.http.main --orchestrator 127.0.0.1:8001 --http-port 8007``.
"""
