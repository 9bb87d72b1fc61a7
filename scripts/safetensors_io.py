"""Minimal safetensors reader and writer for the fixture scripts.

Format (huggingface/safetensors): an 8-byte little-endian header length, a UTF-8 JSON header
{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the
tensors' little-endian row-major bytes. Debian ships no Python safetensors module, so the few
lines are written here; the header is padded with spaces so the data starts 8-byte aligned.
"""

import json
import struct
from pathlib import Path

import numpy as np

# BF16 tensors are held as their raw 16-bit patterns in uint16 arrays (no fixture stores U16
# tensors, so the mapping is unambiguous).
DTYPES = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "I64": np.dtype("<i8"),
          "BF16": np.dtype("<u2")}


def dtype_name(array):
    for name, dtype in DTYPES.items():
        if array.dtype == dtype:
            return name
    raise TypeError(f"unsupported dtype {array.dtype}")


def encode_safetensors(arrays, metadata):
    """Serialize an ordered dict name -> little-endian ndarray to safetensors bytes."""
    header = {"__metadata__": metadata}
    chunks = []
    offset = 0
    for name, array in arrays.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype_name(array), "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    return struct.pack("<Q", len(header_bytes)) + header_bytes + b"".join(chunks)


def read_safetensors(path):
    """Return (metadata, ordered dict name -> ndarray, dict name -> dtype string)."""
    blob = Path(path).read_bytes()
    (header_len,) = struct.unpack_from("<Q", blob, 0)
    data_start = 8 + header_len
    if data_start % 8 != 0:
        raise ValueError(f"{path}: data section starts at unaligned offset {data_start}")
    header = json.loads(blob[8:data_start].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"{path}: __metadata__ must map strings to strings")
    data = blob[data_start:]
    tensors = {}
    expected_begin = 0
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if begin != expected_begin or end - begin != count * dtype.itemsize:
            raise ValueError(f"{path}: bad data_offsets for {name}")
        tensors[name] = np.frombuffer(data[begin:end], dtype=dtype).reshape(info["shape"])
        expected_begin = end
    if expected_begin != len(data):
        raise ValueError(f"{path}: {len(data) - expected_begin} trailing bytes")
    ordered = {name: tensors[name] for name in header}
    dtypes = {name: header[name]["dtype"] for name in header}
    return metadata, ordered, dtypes
