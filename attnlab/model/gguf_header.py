"""The GGUF header, walked with every count and length checked against the bytes left in the file.

The `gguf` package's reader builds whatever a header claims (one changed byte made it
allocate 4.5 GB for an "array" architecture value); this walk runs first and rejects such
files in milliseconds. It also gives `attnlab info` the metadata without reading a tensor.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.model.files import ModelLoadError

MAX_TENSORS = 1 << 16
MAX_KV = 1 << 16


def error(path, what: str):
    """A ModelLoadError naming `path`."""
    return ModelLoadError(f"{path}: {what}")

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass
class GGUFArray:
    """An array value: its item type and length (the items themselves are not kept)."""
    item_type: int
    count: int


@dataclass
class GGUFTensorInfo:
    shape: tuple[int, ...]  # row-major (Hugging Face) order: GGUF's dims reversed
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int


@dataclass
class GGUFHeader:
    version: int
    meta: dict = field(default_factory=dict)  # key -> int | float | bool | str | GGUFArray
    tensors: dict[str, GGUFTensorInfo] = field(default_factory=dict)
    data_offset: int = 0
    order: str = "<"  # struct's byte order of the file: "<" little-endian, ">" big-endian


class _Cursor:
    """Bounds-checked little/big-endian reads over a mapped file."""

    def __init__(self, buf, path, order: str):
        self.buf, self.path, self.order, self.pos, self.size = buf, path, order, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise error(self.path, f"corrupt or truncated GGUF file: {what} needs {n} bytes at offset {self.pos}, "
                                   f"the file has {self.size - self.pos} left")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.unpack("Q", what)
        if limit is not None and n > limit:
            raise error(self.path, f"{what} claims {n} bytes (limit {limit})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise error(self.path, f"{what} at offset {self.pos - n} is not UTF-8") from None

    def skip_string(self, what: str) -> None:
        n = self.unpack("Q", what)
        self.need(n, what)
        self.pos += n

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings read in a tight loop (a vocabulary: 150k in ~0.1 s); a bad one falls back to string()."""
        unpack, buf, pos, size, out = struct.Struct(self.order + "Q").unpack_from, self.buf, self.pos, self.size, []
        try:
            for _ in range(count):
                n = unpack(buf, pos)[0]
                if pos + 8 + n > size:
                    raise ValueError
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
                pos += 8 + n
        except (ValueError, struct.error):
            self.pos = pos
            self.string(what)  # raises, naming the offset
        self.pos = pos
        return out

    def skip_strings(self, count: int, what: str) -> None:
        """`count` strings skipped in a tight loop (a vocabulary and its merges: ~100k, a second of `skip_string`
        calls); a bad length falls back to skip_string for its message."""
        unpack, buf, pos, size = struct.Struct(self.order + "Q").unpack_from, self.buf, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size or pos + 8 + unpack(buf, pos)[0] > size:
                self.pos = pos
                self.skip_string(what)  # raises, naming the offset
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos


def _value(cur: _Cursor, vtype: int, key: str, depth: int = 0, keep: bool = False):
    if vtype in _SCALARS:
        value = cur.unpack(_SCALARS[vtype], key)
        return bool(value) if vtype == 7 else value
    if vtype == 8:
        return cur.string(key)
    if vtype == 9:
        if depth:
            raise error(cur.path, f"metadata {key}: nested arrays are not supported")
        itype = cur.unpack("I", f"{key} item type")
        count = cur.unpack("Q", f"{key} length")
        if itype in _SCALARS:
            size = struct.calcsize("<" + _SCALARS[itype])
            cur.need(count * size, f"{key} ({count} items)")
            if keep:
                values = list(struct.unpack_from(f"{cur.order}{count}{_SCALARS[itype]}", cur.buf, cur.pos))
            cur.pos += count * size
        elif itype == 8:
            cur.need(count * 8, f"{key} ({count} strings)")  # each string has at least its 8-byte length
            if keep:
                values = cur.strings(count, key)
            else:
                cur.skip_strings(count, key)
        else:
            raise error(cur.path, f"metadata {key}: unsupported array item type {itype}")
        return values if keep else GGUFArray(itype, count)
    raise error(cur.path, f"metadata {key}: unknown value type {vtype}")


# ggml type id -> (name, values per block, bytes per block) for the types Llama-family files use; the
# `gguf` package (0.2 s to import, with numpy and sentencepiece) is asked only about others.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
              12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}


def ggml_type(type_id: int) -> tuple[str, int, int]:
    """(name, block, type size) of a ggml type id; KeyError or ValueError when unknown."""
    if type_id in GGML_TYPES:
        return GGML_TYPES[type_id]
    import gguf
    kind = gguf.GGMLQuantizationType(type_id)
    return (kind.name, *gguf.GGML_QUANT_SIZES[kind])


def scan_gguf(path: Path, keep: tuple[str, ...] = ()) -> GGUFHeader:
    """Walk a GGUF header with every length checked against the file: metadata and tensor table, no tensor data.
    Arrays are kept as their type and length (GGUFArray), except those named in `keep`: lists of their values."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # empty file
            raise error(path, "not a GGUF file (empty)") from None
    with buf:
        if buf[:4] != b"GGUF":
            raise error(path, "not a GGUF file")
        cur = _Cursor(buf, path, "<")
        cur.pos = 4
        version = cur.unpack("I", "version")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            cur.order, cur.pos = ">", 4
            version = cur.unpack("I", "version")
        if version not in (2, 3):
            raise error(path, f"GGUF version {version} is not supported (2 or 3)")
        n_tensors = cur.unpack("Q", "tensor count")
        n_kv = cur.unpack("Q", "metadata count")
        if n_kv > MAX_KV or n_kv * 13 > cur.size - cur.pos:  # key length 8 + type 4 + 1 byte of value
            raise error(path, f"corrupt or truncated GGUF file: header claims {n_kv} metadata entries, more than the file can hold")
        if n_tensors > MAX_TENSORS or n_tensors * 24 > cur.size - cur.pos:
            raise error(path, f"corrupt or truncated GGUF file: header claims {n_tensors} tensors, more than the file can hold")
        head = GGUFHeader(version, order=cur.order)
        for _ in range(n_kv):
            key = cur.string("metadata key", limit=1 << 16)
            if key in head.meta:
                raise error(path, f"metadata {key} appears twice")
            head.meta[key] = _value(cur, cur.unpack("I", f"{key} type"), key, keep=key in keep)
        infos = []
        for _ in range(n_tensors):
            name = cur.string("tensor name", limit=1 << 12)
            n_dims = cur.unpack("I", f"tensor {name} dimension count")
            if not 1 <= n_dims <= 4:
                raise error(path, f"tensor {name} has {n_dims} dimensions (1 to 4 allowed)")
            dims = [cur.unpack("Q", f"tensor {name} dimensions") for _ in range(n_dims)]
            type_id = cur.unpack("I", f"tensor {name} type")
            offset = cur.unpack("Q", f"tensor {name} offset")
            infos.append((name, dims, type_id, offset))
        alignment = head.meta.get("general.alignment", 32)
        if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1) or alignment > 1 << 20:
            raise error(path, f"general.alignment must be a power of two, got {alignment!r}")
        head.data_offset = -(-cur.pos // alignment) * alignment
        room = cur.size - head.data_offset
        for name, dims, type_id, offset in infos:
            if name in head.tensors:
                raise error(path, f"tensor {name} appears twice")
            try:
                _, block, type_size = ggml_type(type_id)
            except (ValueError, KeyError):
                raise error(path, f"tensor {name} has unknown type {type_id}") from None
            if min(dims) < 1 or max(dims) > 1 << 32 or dims[0] % block:
                raise error(path, f"tensor {name} has impossible dimensions {dims}")
            nbytes = math.prod(dims) // block * type_size
            if offset % alignment or offset + nbytes > room:
                raise error(path, f"corrupt or truncated GGUF file: tensor {name} ({nbytes} bytes at data offset {offset}) lies outside the file")
            head.tensors[name] = GGUFTensorInfo(tuple(reversed(dims)), type_id, offset, nbytes)
    return head
