"""A small, dependency-free writer and reader for the safetensors file format.

Format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian
unsigned header length N, N bytes of UTF-8 JSON, then the raw tensor bytes. The JSON maps
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets
relative to the start of the data section, plus an optional ``__metadata__`` of str->str.

The mirror writes its shards with this module so that the generator needs nothing but the
standard library; the tests read them back with it (and, in a throwaway venv, with the real
``safetensors`` package) to prove the files are valid.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# Bytes per element for the dtypes the mirror can write or read.
DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "U8": 1}

# The real library refuses headers above 100 MB; a corrupt length must not make us allocate.
MAX_HEADER_BYTES = 100 * 1000 * 1000


class SafetensorsError(ValueError):
    """The bytes are not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def element_count(shape: tuple[int, ...] | list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def encode(tensors: list[tuple[str, str, tuple[int, ...], bytes]],
           metadata: dict[str, str] | None = None) -> bytes:
    """Serialise ``(name, dtype, shape, raw_bytes)`` tuples, in the given order.

    The data section is packed with no gaps, which the real reader insists on.
    """
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape, data in tensors:
        expected = element_count(shape) * DTYPE_SIZES[dtype]
        if len(data) != expected:
            raise SafetensorsError(f"{name}: {len(data)} bytes, shape {shape} needs {expected}")
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces to 8 bytes so the data section is aligned, as the real writer does.
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(t[3] for t in tensors)


def write(path: Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]],
          metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file; return its size in bytes."""
    blob = encode(tensors, metadata)
    path.write_bytes(blob)
    return len(blob)


def parse_header(blob: bytes) -> tuple[dict[str, str], list[TensorInfo], int]:
    """Return ``(metadata, tensors sorted by offset, data_start)``, validating the layout.

    The checks mirror the real library's: header length in bounds, JSON object, known
    dtypes, offsets that match the shape, and a data section covered exactly once.
    """
    if len(blob) < 8:
        raise SafetensorsError("shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(blob):
        raise SafetensorsError(f"header length {header_len} out of bounds")
    try:
        header = json.loads(blob[8:8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    tensors = sorted((_tensor_info(name, entry) for name, entry in header.items()),
                     key=lambda t: (t.begin, t.end))
    data_start = 8 + header_len
    _check_coverage(tensors, len(blob) - data_start)
    return metadata, tensors, data_start


def _tensor_info(name: str, entry: object) -> TensorInfo:
    if not isinstance(entry, dict):
        raise SafetensorsError(f"{name}: entry is not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise SafetensorsError(f"{name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        raise SafetensorsError(f"{name}: bad shape or data_offsets")
    begin, end = offsets
    if end - begin != element_count(shape) * DTYPE_SIZES[dtype]:
        raise SafetensorsError(f"{name}: data_offsets {offsets} do not match shape {shape}")
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _check_coverage(tensors: list[TensorInfo], data_len: int) -> None:
    position = 0
    for tensor in tensors:
        if tensor.begin != position:
            raise SafetensorsError(f"{tensor.name}: gap or overlap at byte {position}")
        position = tensor.end
    if position != data_len:
        raise SafetensorsError(f"data section is {data_len} bytes, tensors cover {position}")


def read(path: Path) -> tuple[dict[str, str], dict[str, tuple[TensorInfo, bytes]]]:
    """Read a whole file: ``(metadata, {name: (info, raw_bytes)})``."""
    blob = path.read_bytes()
    metadata, tensors, data_start = parse_header(blob)
    return metadata, {t.name: (t, blob[data_start + t.begin:data_start + t.end])
                      for t in tensors}


def bf16_to_floats(raw: bytes) -> list[float]:
    """Widen bf16 values to Python floats (bf16 is the upper half of a float32)."""
    count = len(raw) // 2
    widened = bytearray(count * 4)
    widened[2::4] = raw[0::2]
    widened[3::4] = raw[1::2]
    return list(struct.unpack(f"<{count}f", bytes(widened)))
