"""Reading and amending a serialised v2 message without decoding it.

A hop that only routes a request (the orchestrator forwarding a stage model's
ModelInfer) needs three strings of it: the model's name and version, and the
request id. Decoding the whole message, tensors included, and encoding it
again for the next hop costs more than the routing itself, so these helpers
read the protobuf wire format directly: each top-level field is a tag and a
value, and a length-delimited value (a string, a nested message, a tensor's
bytes) is skipped by its length without being looked at.

Protobuf merges repeated occurrences of a singular field, the last one
winning, so a field is also *set* on a serialised message by appending it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from inference import grpc_service_pb2 as pb
from shared.errors import InvalidArgument

_LENGTH_DELIMITED = 2
_FIXED = {1: 8, 5: 4}
"""Wire types of fixed size -> their byte count (64-bit, 32-bit)."""
_VARINT = 0
_MODEL_NAME, _MODEL_VERSION, _ID, _PARAMETERS = 1, 2, 3, 4
"""Field numbers shared by ModelInferRequest and ModelInferResponse."""


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


@dataclass(frozen=True, slots=True)
class InferHeader:
    """What a hop needs to route a ModelInferRequest."""

    model_name: str
    model_version: str
    id: str


def read_varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    result = shift = 0
    size = len(data)
    while pos < size:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            break
    raise WireError("malformed varint")


def length_delimited(data: bytes | memoryview) -> Iterator[tuple[int, int, int]]:
    """``(number, start, end)`` of each length-delimited field at the top level, in
    order; every other field is stepped over. The caller slices what it wants
    (nothing is copied here), so a message cut short or with a bad tag is a
    WireError only once the walk reaches it."""
    pos, size = 0, len(data)
    while pos < size:
        tag, pos = read_varint(data, pos)
        number, kind = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if kind == _LENGTH_DELIMITED:
            length, pos = read_varint(data, pos)
            end = pos + length
            if end > size:
                raise WireError(f"field {number} runs past the end of the message")
            yield number, pos, end
            pos = end
        elif kind == _VARINT:
            _, pos = read_varint(data, pos)
        elif kind in _FIXED:
            pos += _FIXED[kind]
            if pos > size:
                raise WireError(f"field {number} runs past the end of the message")
        else:
            raise WireError(f"unsupported wire type {kind} (field {number})")


def _strings(data: bytes, wanted: tuple[int, ...]) -> dict[int, bytes]:
    """The last value of each length-delimited field of ``wanted`` at the top level.

    Every field is walked (a field may occur more than once, and the last
    occurrence wins), so a message cut short or with a bad tag is a WireError.
    """
    return {
        number: data[start:end] for number, start, end in length_delimited(data) if number in wanted
    }


def repeated_field(data: bytes, number: int) -> list[bytes]:
    """Every value of the length-delimited field ``number`` at the top level, in
    order (the messages of a ``repeated`` message field, still serialised);
    WireError if the message is malformed or holds another field."""
    values: list[bytes] = []
    pos, size = 0, len(data)
    tag = number << 3 | _LENGTH_DELIMITED
    while pos < size:
        found, pos = read_varint(data, pos)
        if found != tag:
            raise WireError(f"unexpected field {found >> 3} (wire type {found & 7})")
        length, pos = read_varint(data, pos)
        end = pos + length
        if end > size:
            raise WireError(f"field {number} runs past the end of the message")
        values.append(data[pos:end])
        pos = end
    return values


def repeated(number: int, values: Sequence[bytes]) -> bytes:
    """``values`` (serialised messages) as the repeated field ``number`` of a message."""
    return b"".join(repeated_pieces(number, [(value,) for value in values]))


def repeated_pieces(number: int, values: Sequence[Sequence[bytes]]) -> list[bytes]:
    """As ``repeated``, each message given as the pieces it is the concatenation
    of (a request and the fields set on it), and the message as its pieces, in
    order, to be joined as it is written: a large request is then copied once."""
    tag = encode_varint(number << 3 | _LENGTH_DELIMITED)
    out: list[bytes] = []
    for pieces in values:
        out += (tag, encode_varint(sum(map(len, pieces))), *pieces)
    return out


def infer_header(data: bytes) -> InferHeader:
    """Model name, version and id of a serialised ModelInferRequest (or
    response: the fields are numbered alike); WireError if it is malformed."""
    found = _strings(data, (_MODEL_NAME, _MODEL_VERSION, _ID))
    try:
        return InferHeader(
            found.get(_MODEL_NAME, b"").decode(),
            found.get(_MODEL_VERSION, b"").decode(),
            found.get(_ID, b"").decode(),
        )
    except UnicodeDecodeError as exc:
        raise WireError(f"a string field is not UTF-8: {exc}") from None


NOT_A_REQUEST = "the request is not a valid inference.ModelInferRequest message"


def infer_request(data: bytes) -> pb.ModelInferRequest:
    """A serialised ModelInferRequest decoded whole (for a hop that must read its
    tensors); INVALID_ARGUMENT when it is not one."""
    try:
        return pb.ModelInferRequest.FromString(data)
    except DecodeError:
        raise InvalidArgument(NOT_A_REQUEST) from None


def encode_varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return encode_varint(number << 3 | _LENGTH_DELIMITED) + encode_varint(len(payload)) + payload


def string_field(number: int, value: str) -> bytes:
    """One length-delimited field, serialised (append it to set the field)."""
    return _length_delimited(number, value.encode())


def id_field(request_id: str) -> bytes:
    """The id field of a ModelInferRequest or ModelInferResponse (appended: sets it)."""
    return string_field(_ID, request_id)


def with_id(data: bytes, request_id: str) -> bytes:
    """A serialised ModelInferRequest or ModelInferResponse with its id set."""
    return data + id_field(request_id)


def string_parameters(parameters: Mapping[str, str]) -> bytes:
    """Each of ``parameters`` as a ModelInferRequest ``string_param`` (map entries:
    appended to a request, the last entry of a key wins)."""
    # map<string, InferParameter> entry: key = 1, value = 2 {string_param = 3}.
    entries = (
        string_field(1, key) + _length_delimited(2, string_field(3, value))
        for key, value in parameters.items()
    )
    return b"".join(_length_delimited(_PARAMETERS, entry) for entry in entries)


def stream_answer(data: bytes) -> tuple[str, bytes]:
    """A serialised ModelStreamInferResponse as its ``error_message`` (empty when
    none) and its ``infer_response``, still serialised."""
    found = _strings(data, (1, 2))
    return found.get(1, b"").decode(errors="replace"), found.get(2, b"")
