"""HPACK (RFC 7541): a decoder that keeps the dynamic table in step with its peer's
encoder, and an encoder that writes every field as a literal "without indexing", so
it keeps no table state. Used by the lean gRPC server (shared/h2grpc/) and by the
closed loop's gRPC client (loadtests/grpc_connection.py)."""

from __future__ import annotations

import functools

# One string, as the RFC's table reads: 61 names in order.
_STATIC_NAMES = (  # noqa: SIM905
    ":authority :method :method :path :path :scheme :scheme :status :status :status :status "
    ":status :status :status accept-charset accept-encoding accept-language accept-ranges "
    "accept access-control-allow-origin age allow authorization cache-control "
    "content-disposition content-encoding content-language content-length content-location "
    "content-range content-type cookie date etag expect expires from host if-match "
    "if-modified-since if-none-match if-range if-unmodified-since last-modified link "
    "location max-forwards proxy-authenticate proxy-authorization range referer refresh "
    "retry-after server set-cookie strict-transport-security transfer-encoding user-agent "
    "vary via www-authenticate"
).split()
_STATIC_VALUES = {2: "GET", 3: "POST", 4: "/", 5: "/index.html", 6: "http", 7: "https"}
_STATIC_VALUES |= {8: "200", 9: "204", 10: "206", 11: "304", 12: "400", 13: "404", 14: "500"}
_STATIC_VALUES |= {16: "gzip, deflate"}
STATIC_TABLE = [
    (name.encode(), _STATIC_VALUES.get(index, "").encode())
    for index, name in enumerate(_STATIC_NAMES, 1)
]
"""RFC 7541 Appendix A: entries 1 to 61."""

_HUFFMAN_LENGTHS = (
    "ISXXXXXXXTZXXZXXXXXXXXZXXXXXXXXXBFFHIBDGFFDGDBBBAAABBBBBBBCDKBHFIBCCCCCCCCCCCCCCCCCCCCCCDCD"
    "IOIJBKABABABBBACCBBBABCBAABCCCCCKGJIXPRPPRRRSRSSSSSTSTTRSTSSSSQRSRSSTRQPRRSSQSRRTQRSSQQRQSR"
    "SSPRRRSRRSVVPORSRUVVVWWVTUOQVWWVWTQQVVXWWWPTPQRQQSRRUUTTVSVWVVWWWWWXWWWWWVZ"
)
"""The bit length of each symbol's code (RFC 7541 Appendix B; "A" is 5 bits), 0-255 and
EOS. The code is canonical: codes of one length count up in symbol order, so the
lengths alone give every code."""


def _huffman_codes() -> dict[tuple[int, int], int]:
    lengths = [ord(letter) - ord("A") + 5 for letter in _HUFFMAN_LENGTHS]
    codes: dict[tuple[int, int], int] = {}
    code = previous = 0
    for symbol in sorted(range(257), key=lambda s: (lengths[s], s)):
        code <<= lengths[symbol] - previous
        previous = lengths[symbol]
        codes[previous, code] = symbol
        code += 1
    return codes


HUFFMAN_CODES = _huffman_codes()
"""(bit length, code) -> symbol (256: EOS)."""


def _code_tree() -> list[list[int]]:
    """The Huffman code as a tree: node -> [child on 0, child on 1]; node 0 is the root,
    a leaf is ``~symbol`` (negative)."""
    children = [[0, 0]]  # 0 as a child: not yet made (the root is nobody's child)
    for (length, code), symbol in HUFFMAN_CODES.items():
        node = 0
        for shift in range(length - 1, 0, -1):
            bit = (code >> shift) & 1
            if not children[node][bit]:
                children.append([0, 0])
                children[node][bit] = len(children) - 1
            node = children[node][bit]
        children[node][code & 1] = ~symbol
    return children


def _nibble_table(children: list[list[int]]) -> list[tuple[int, int]]:
    """(node << 4 | four bits) -> (the node after them, the symbol they end or -1). No
    code is shorter than 5 bits, so four bits end at most one."""
    table = []
    for start in range(len(children)):
        for nibble in range(16):
            node, symbol = start, -1
            for shift in (3, 2, 1, 0):
                child = children[node][(nibble >> shift) & 1]
                node, symbol = (0, ~child) if child < 0 else (child, symbol)
            table.append((node, symbol))
    return table


def _padding_nodes(children: list[list[int]]) -> frozenset[int]:
    """Where a string may end: at most 7 bits of EOS's prefix (all ones) past a code."""
    nodes, node = [0], 0
    for _ in range(7):
        node = children[node][1]
        nodes.append(node)
    return frozenset(nodes)


_TREE = _code_tree()
_PADDING = _padding_nodes(_TREE)
_EOS = 256
_AFTER_EOS = len(_TREE)
"""The state a string is in once EOS appeared inside it: refused whatever follows."""


@functools.cache
def _byte_table() -> tuple[list[int], list[bytes]]:
    """(node << 8 | byte) -> the node after those eight bits, and the symbols they end
    (at most two, as no code is shorter than 5 bits). Made on the first Huffman-coded
    string (~45 ms, ~1.5 MB), so a process that never reads one holds none of it."""
    nibbles = _nibble_table(_TREE)
    nodes: list[int] = []
    ends: list[bytes] = []
    shared: dict[bytes, bytes] = {}
    for start in range(len(_TREE)):
        for byte in range(256):
            node, first = nibbles[start << 4 | byte >> 4]
            node, second = nibbles[node << 4 | byte & 15]
            if _EOS in (first, second):
                nodes.append(_AFTER_EOS)
                ends.append(b"")
                continue
            symbols = bytes(symbol for symbol in (first, second) if symbol >= 0)
            nodes.append(node)
            ends.append(shared.setdefault(symbols, symbols))
    nodes += [_AFTER_EOS] * 256
    ends += [b""] * 256
    return nodes, ends


def huffman_decode(data: bytes) -> bytes:
    """A Huffman-coded string literal (RFC 7541 5.2), a byte a step."""
    nodes, ends = _byte_table()
    out, node = bytearray(), 0
    for byte in data:
        index = node << 8 | byte
        node = nodes[index]
        out += ends[index]
    if node == _AFTER_EOS:
        raise ValueError("EOS inside a Huffman-coded string")
    if node not in _PADDING:
        raise ValueError("bad padding after a Huffman-coded string")
    return bytes(out)


def _integer(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """An integer with a ``prefix``-bit prefix at ``pos`` (RFC 7541 5.1); and where it ends."""
    mask = (1 << prefix) - 1
    value, pos = block[pos] & mask, pos + 1
    shift = 0
    while value >= mask:
        byte, pos = block[pos], pos + 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return value, pos


def _string(
    block: bytes, pos: int, repeated: dict[bytes, bytes] | None = None
) -> tuple[bytes, int]:
    """The string at ``pos``, and where it ends. ``repeated``: Huffman-coded strings
    already decoded, to look up first and to keep this one in."""
    coded = block[pos] & 0x80
    size, pos = _integer(block, pos, 7)
    if pos + size > len(block):
        raise ValueError("a header string runs past its block")
    raw = block[pos : pos + size]
    if not coded:
        return raw, pos + size
    if repeated is None or size > REPEATED_BYTES:
        return huffman_decode(raw), pos + size
    key = bytes(raw)  # the same object for a block of bytes; a copy of any other
    text = repeated.get(key)
    if text is None:
        text = huffman_decode(key)
        if len(repeated) >= REPEATED_STRINGS:
            repeated.clear()
        repeated[key] = text
    return text, pos + size


def _encoded_integer(value: int, prefix: int, flags: int) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes((flags | value,))
    out, value = bytearray((flags | mask,)), value - mask
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes((*out, value))


def literal(name: bytes, value: bytes, name_index: int = 0) -> bytes:
    """A field "without indexing" (RFC 7541 6.2.2): no table state on either side.
    ``name_index``: the name's static table entry, 0 to spell the name out."""
    return _field(name_index, name, value)


def _field(name_index: int, name: bytes, value: bytes) -> bytes:
    out = _encoded_integer(name_index, 4, 0x00)
    if not name_index:
        out += _encoded_integer(len(name), 7, 0x00) + name
    return out + _encoded_integer(len(value), 7, 0x00) + value


def request_headers(method: str, authority: str) -> bytes:
    """The header block of a unary gRPC call (static indices: 3 POST, 6 http, 4 :path,
    1 :authority, 31 content-type)."""
    block = b"\x83\x86" + _field(4, b"", method.encode()) + _field(1, b"", authority.encode())
    return block + _field(31, b"", b"application/grpc") + _field(0, b"te", b"trailers")


REPEATED_STRINGS = 32
"""Strings of fields sent without indexing (not "never indexed") that a decoder
keeps decoded. An encoder that does not index a field spells it out in every
block, the same bytes each time (Envoy's HTTP/2 codec indexes no pseudo-header but
``:authority``, so every request carries its ``:path`` so); an indexed field is
read from the table instead."""
REPEATED_BYTES = 256
"""Longest such string kept (its coded length), so the strings kept stay small."""


class HeaderDecoder:
    """HPACK: header blocks -> fields, with the dynamic table kept in step."""

    def __init__(self, max_size: int = 4096) -> None:
        self._table: list[tuple[bytes, bytes]] = []
        """Newest first: index 62 is ``_table[0]``."""
        self._size, self._max, self._limit = 0, max_size, max_size
        self._repeated: dict[bytes, bytes] = {}
        """Huffman-coded strings of fields sent without indexing, decoded (see
        ``REPEATED_STRINGS``)."""

    def decode(self, block: bytes) -> dict[bytes, bytes]:
        """The fields of one whole header block (a repeated name: its last value)."""
        return dict(self.decode_pairs(block))

    def decode_pairs(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The fields of one whole header block, in order, repeated names and all."""
        fields: list[tuple[bytes, bytes]] = []
        pos = 0
        while pos < len(block):
            first = block[pos]
            if first & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                name, value = self._entry(index)
            elif first & 0x40:  # literal, added to the table
                name, value, pos = self._literal(block, pos, 6)
                self._add(name, value)
            elif first & 0x20:  # dynamic table size update
                self._max, pos = _integer(block, pos, 5)
                if self._max > self._limit:
                    raise ValueError("HPACK table size above the one we allow")
                self._evict()
                continue
            else:  # literal, not indexed (0000) or never indexed (0001)
                # A never-indexed field (a credential) is not kept: a decode that
                # finds it kept would take less time, telling a guess on the
                # connection from the value sent.
                kept = None if first & 0x10 else self._repeated
                name, value, pos = self._literal(block, pos, 4, kept)
            fields.append((name, value))
        return fields

    def _literal(
        self, block: bytes, pos: int, prefix: int, repeated: dict[bytes, bytes] | None = None
    ) -> tuple[bytes, bytes, int]:
        index, pos = _integer(block, pos, prefix)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = _string(block, pos, repeated)
        value, pos = _string(block, pos, repeated)
        return name, value, pos

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        if 0 <= index - len(STATIC_TABLE) - 1 < len(self._table):
            return self._table[index - len(STATIC_TABLE) - 1]
        raise ValueError(f"HPACK index {index} is not in the table")

    def _add(self, name: bytes, value: bytes) -> None:
        self._table.insert(0, (name, value))
        self._size += 32 + len(name) + len(value)
        self._evict()

    def _evict(self) -> None:
        while self._size > self._max:
            name, value = self._table.pop()
            self._size -= 32 + len(name) + len(value)
