"""The HPACK decoder (shared/hpack.py) on RFC 7541's own examples:
header blocks with Huffman-coded strings, and the dynamic table kept across blocks."""

from __future__ import annotations

import random

import pytest

from shared.hpack import HUFFMAN_CODES, HeaderDecoder, huffman_decode

CODES = {symbol: (length, code) for (length, code), symbol in HUFFMAN_CODES.items()}


def huffman_encode(text: bytes, padding: str = "") -> bytes:
    """The RFC's encoding, bit by bit; ``padding``: the bits after the last code (by
    default EOS's prefix up to the next byte)."""
    bits = "".join(format(CODES[b][1], f"0{CODES[b][0]}b") for b in text)
    bits += padding or "1" * (-len(bits) % 8)
    assert len(bits) % 8 == 0
    return int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""


def decode_bit_by_bit(data: bytes) -> bytes:
    """The RFC's decoding, a bit at a time, to hold the table-driven one to."""
    out, code, bits = bytearray(), 0, 0
    for bit in "".join(format(byte, "08b") for byte in data):
        code, bits = code << 1 | int(bit), bits + 1
        symbol = HUFFMAN_CODES.get((bits, code))
        if symbol == 256:
            raise ValueError("EOS")
        if symbol is not None:
            out.append(symbol)
            code, bits = 0, 0
    if bits > 7 or code != (1 << bits) - 1:
        raise ValueError("padding")
    return bytes(out)


def test_requests_with_huffman_strings_and_the_dynamic_table() -> None:
    decoder = HeaderDecoder()
    first = bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff")  # C.4.1
    assert decoder.decode(first) == {
        b":method": b"GET",
        b":scheme": b"http",
        b":path": b"/",
        b":authority": b"www.example.com",
    }
    second = bytes.fromhex("828684be5886a8eb10649cbf")  # C.4.2: :authority from the table
    assert decoder.decode(second) == {
        b":method": b"GET",
        b":scheme": b"http",
        b":path": b"/",
        b":authority": b"www.example.com",
        b"cache-control": b"no-cache",
    }


def test_a_response_block_and_a_huffman_string() -> None:
    block = bytes.fromhex(  # C.6.1
        "488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff"
        "6e919d29ad171863c78f0b97c8e9ae82ae43d3"
    )
    assert HeaderDecoder(256).decode(block) == {
        b":status": b"302",
        b"cache-control": b"private",
        b"date": b"Mon, 21 Oct 2013 20:13:21 GMT",
        b"location": b"https://www.example.com",
    }
    assert huffman_decode(bytes.fromhex("f1e3c2e5f23a6ba0ab90f4ff")) == b"www.example.com"


def test_every_byte_value_round_trips_through_the_huffman_code() -> None:
    rng = random.Random(7)
    texts = [bytes(range(256)), b"", b"Thu, 03 Dec 2026 15:36:39 GMT"]
    texts += [rng.randbytes(rng.randrange(1, 40)) for _ in range(500)]
    for text in texts:
        assert huffman_decode(huffman_encode(text)) == text


def test_arbitrary_bytes_decode_as_the_bit_by_bit_reading_does() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        data = rng.randbytes(rng.randrange(0, 12))
        try:
            expected: bytes | type[ValueError] = decode_bit_by_bit(data)
        except ValueError:
            expected = ValueError
        if expected is ValueError:
            with pytest.raises(ValueError):
                huffman_decode(data)
        else:
            assert huffman_decode(data) == expected


def _huffman_field(flags: int, name_index: int, value: bytes) -> bytes:
    """A literal field on a static name, its value Huffman-coded: ``flags`` 0x40 adds
    it to the table (a 6-bit index), 0x00 not indexed, 0x10 never indexed (4 bits)."""
    coded = huffman_encode(value)
    mask = 0x3F if flags == 0x40 else 0x0F
    assert len(coded) < 127 and name_index - mask < 127
    index = (
        bytes((flags | name_index,))
        if name_index < mask
        else bytes((flags | mask, name_index - mask))
    )
    return index + bytes((0x80 | len(coded),)) + coded


def test_fields_sent_whole_in_every_block_decode_each_time() -> None:
    """As Envoy sends requests: ``:path`` without indexing in every block (the same
    bytes, or one of many paths) beside a new value added to the table each time."""
    decoder = HeaderDecoder()
    rng = random.Random(5)
    paths = [b"/inference.GRPCInferenceService/ModelInfer"]
    paths += [f"/v2/models/m{n}/infer".encode() for n in range(80)]
    for request in range(400):
        path = paths[0] if request % 2 else rng.choice(paths)
        request_id = f"{rng.getrandbits(128):032x}".encode()
        block = b"\x83\x86" + _huffman_field(0x00, 4, path) + _huffman_field(0x10, 4, path)
        block += _huffman_field(0x40, 1, request_id)  # :authority, added to the table
        # A caller may hand over its buffer as it is (a bytearray) rather than bytes.
        assert decoder.decode_pairs(block if request % 3 else bytearray(block)) == [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":path", path),
            (b":authority", request_id),
        ]


def test_a_never_indexed_field_leaves_no_trace_in_the_decoder() -> None:
    """A credential sent "never indexed" (RFC 7541 7.1.3) is decoded each time and
    kept nowhere: neither in the table nor among the strings kept decoded."""
    decoder = HeaderDecoder()
    for _ in range(3):
        secret = f"Bearer {random.getrandbits(96):024x}".encode()
        block = _huffman_field(0x00, 4, b"/v2/health/ready") + _huffman_field(0x10, 23, secret)
        assert decoder.decode_pairs(block) == [
            (b":path", b"/v2/health/ready"),
            (b"authorization", secret),
        ]
        assert secret not in repr(vars(decoder)).encode()


@pytest.mark.parametrize(
    ("text", "after", "reason"),
    [
        (b"ab", "1" * 30 + "1" * 7, "EOS inside"),  # 11 bits, EOS, then 7 of padding
        (b"a", "1" * 11, "bad padding"),  # 5 bits, then more than 7 of padding
        (b"a", "110", "bad padding"),  # padding that is not EOS's prefix
    ],
)
def test_a_string_that_breaks_the_huffman_rules_is_refused(
    text: bytes, after: str, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        huffman_decode(huffman_encode(text, after))
