"""JSON tensor ``data`` <-> the raw little-endian bytes every hop of the mesh reads.

Inputs may nest ``data`` (``[[1, 2], [3, 4]]``) or send it flat; only the
element count must match the shape. Values are checked against the datatype
(no silent float-to-int truncation or integer wrap-around) and every error
names the tensor. BYTES elements are UTF-8 strings; FP16 and BF16 travel as
JSON numbers (tritonclient itself sends BF16 only as binary data).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.errors import InvalidArgument
from shared.tensors import DATATYPES, decode_raw, element_count, serialize_bytes

_UINT64_MAX = 2**64 - 1
_FLOATS = frozenset({"FP16", "FP32", "FP64", "BF16"})
_KIND_NAMES = {"b": "booleans", "f": "fractional numbers", "U": "strings"}


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = []
    for item in data:
        if isinstance(item, list):
            flat.extend(_flatten(item))
        else:
            flat.append(item)
    return flat


def _check_count(what: str, shape: list[int], count: int, got: int) -> None:
    if got != count:
        raise InvalidArgument(f"{what}: shape {shape} needs {count} elements, 'data' has {got}")


def _json_bytes(what: str, shape: list[int], count: int, data: Any) -> bytes:
    items = _flatten(data)
    _check_count(what, shape, count, len(items))
    for item in items:
        if not isinstance(item, str):
            raise InvalidArgument(
                f"{what}: BYTES data must be strings, got {type(item).__name__} {item!r:.40}"
            )
    array = np.empty(len(items), dtype=object)
    array[:] = [item.encode() for item in items]
    return serialize_bytes(array)


def _check_kind(what: str, datatype: str, values: np.ndarray) -> None:
    kind = values.dtype.kind
    if values.size == 0:
        return
    if datatype == "BOOL":
        ok, expected = kind == "b", "true/false"
    elif datatype in _FLOATS:
        ok, expected = kind in "iuf", "numbers"
    else:
        ok, expected = kind in "iu", "integers"
    if not ok:
        found = _KIND_NAMES.get(kind, "mixed values")
        raise InvalidArgument(f"{what}: {datatype} data must be {expected}, got {found}")
    if kind in "iu" and datatype not in _FLOATS:
        info = np.iinfo(DATATYPES[datatype])
        if values.min() < info.min or values.max() > info.max:
            raise InvalidArgument(
                f"{what}: a value is outside the {datatype} range [{info.min}, {info.max}]"
            )


def _exact_uint64(what: str, data: Any) -> np.ndarray:
    # Values past 2**63 make numpy infer float64 (losing digits); keep them exact.
    values = np.asarray(data, dtype=object)
    items = values.reshape(-1)
    if not all(type(item) is int and 0 <= item <= _UINT64_MAX for item in items):
        raise InvalidArgument(f"{what}: UINT64 data must be integers in [0, {_UINT64_MAX}]")
    return items.astype(np.uint64).reshape(values.shape)


def json_to_raw(name: str, datatype: str, shape: list[int], data: Any) -> bytes:
    """An input's JSON ``data`` as raw little-endian bytes (length-prefixed for BYTES)."""
    what = f"input '{name}'"
    dtype = DATATYPES.get(datatype)
    if dtype is None:
        raise InvalidArgument(
            f"{what}: unknown datatype '{datatype}' (expected one of {', '.join(DATATYPES)})"
        )
    count = element_count(what, shape)
    if data is None:
        raise InvalidArgument(f"{what}: no 'data' and no 'binary_data_size' parameter")
    if datatype == "BYTES":
        return _json_bytes(what, shape, count, data)
    try:
        values = np.asarray(data)
    except ValueError:
        raise InvalidArgument(f"{what}: 'data' is not a rectangular array") from None
    if datatype == "UINT64" and values.dtype.kind in "fO":
        values = _exact_uint64(what, data)
    _check_count(what, shape, count, values.size)
    _check_kind(what, datatype, values)
    with np.errstate(over="ignore"):
        # DATATYPES are little-endian and astype's copy is contiguous: its bytes are the raw form.
        raw: bytes = values.astype(dtype).tobytes()
        return raw


def raw_to_data(name: str, datatype: str, shape: list[int], raw: bytes) -> np.ndarray | list[Any]:
    """An output's raw bytes as flat JSON ``data``: a numpy array orjson writes as a
    list (``OPT_SERIALIZE_NUMPY``), or a list of strings for BYTES."""
    if datatype == "BYTES":
        return raw_to_json(name, datatype, shape, raw)
    array = decode_raw(name, datatype, shape, raw).reshape(-1)
    if datatype in ("FP16", "BF16"):
        return array.astype(np.float32)
    return array


def raw_to_json(name: str, datatype: str, shape: list[int], raw: bytes) -> list[Any]:
    """An output's raw bytes as flat JSON ``data`` (row-major)."""
    array = decode_raw(name, datatype, shape, raw).reshape(-1)
    if datatype == "BYTES":
        try:
            return [bytes(item).decode() for item in array]
        except UnicodeDecodeError:
            raise InvalidArgument(
                f"output '{name}' holds bytes that are not UTF-8; request it with "
                "parameters.binary_data = true"
            ) from None
    if datatype in ("FP16", "BF16"):
        array = array.astype(np.float32)
    values: list[Any] = array.tolist()
    return values
