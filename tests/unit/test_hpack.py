"""The HPACK decoder (shared/hpack.py) on RFC 7541's own examples:
header blocks with Huffman-coded strings, and the dynamic table kept across blocks."""

from __future__ import annotations

from shared.hpack import HeaderDecoder, huffman_decode


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
