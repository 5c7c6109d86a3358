from inference import grpc_service_pb2 as _grpc_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ForwardRequest(_message.Message):
    __slots__ = ("requests", "withdrawn")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWN_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[_grpc_service_pb2.ModelInferRequest]
    withdrawn: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, requests: _Optional[_Iterable[_Union[_grpc_service_pb2.ModelInferRequest, _Mapping]]] = ..., withdrawn: _Optional[_Iterable[str]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[_grpc_service_pb2.ModelStreamInferResponse]
    def __init__(self, answers: _Optional[_Iterable[_Union[_grpc_service_pb2.ModelStreamInferResponse, _Mapping]]] = ...) -> None: ...
