"""Generated KServe v2 / Triton protocol modules (package `inference`).

The *_pb2*.py files here are generated from the .proto files beside them by
`python scripts/gen_protos.py`; edit the .proto files, never the generated code.
"""
