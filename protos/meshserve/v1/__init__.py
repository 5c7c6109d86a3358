"""Generated meshserve.v1 API modules.

The *_pb2*.py files here are generated from meshserve.proto by
`python scripts/gen_protos.py`; edit the .proto file, never the generated code.
"""
