"""Wire dtypes: how values travel as raw little-endian bytes, and how they are widened back.

Storage is float32. FLOAT16 and BFLOAT16 halve the bytes on the wire (bfloat16 keeps
float32's exponent range: the safer choice for gradients); the receiver widens to float32.
"""

from __future__ import annotations

from enum import Enum

import numpy as np

from shardps.errors import InvalidArgument


class WireDType(Enum):
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT64 = 4
    INT64 = 5

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, value) -> "WireDType":
        """From a WireDType, a name ('bf16', 'float16', ...) or a proto enum number (0: FLOAT32)."""
        if isinstance(value, WireDType):
            return value
        if isinstance(value, int):
            found = _BY_NUMBER.get(value)          # every segment of every reply: no Enum call
            if found is None:
                raise InvalidArgument(f"unknown wire dtype number {value}")
            return found
        key = str(value).lower().replace("torch.", "")
        if key in _ALIASES:
            return _ALIASES[key]
        raise InvalidArgument(f"unknown wire dtype {value!r}: use float32, float16 or bfloat16")


_ITEMSIZE = {
    WireDType.FLOAT32: 4, WireDType.FLOAT16: 2, WireDType.BFLOAT16: 2,
    WireDType.FLOAT64: 8, WireDType.INT64: 8,
}
_ALIASES = {
    "float32": WireDType.FLOAT32, "fp32": WireDType.FLOAT32, "float": WireDType.FLOAT32,
    "float16": WireDType.FLOAT16, "fp16": WireDType.FLOAT16, "half": WireDType.FLOAT16,
    "bfloat16": WireDType.BFLOAT16, "bf16": WireDType.BFLOAT16,
    "float64": WireDType.FLOAT64, "fp64": WireDType.FLOAT64, "double": WireDType.FLOAT64,
}
_BY_NUMBER = {0: WireDType.FLOAT32, **{d.value: d for d in WireDType}}    # 0: the proto default
VALUE_DTYPES = (WireDType.FLOAT32, WireDType.FLOAT16, WireDType.BFLOAT16, WireDType.FLOAT64)


def encode(values: np.ndarray, dtype: WireDType) -> np.ndarray:
    """float32 values -> a C-contiguous array whose bytes are the wire form (no copy for FLOAT32)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype is WireDType.FLOAT32:
        return values
    if dtype is WireDType.FLOAT16:
        return values.astype("<f2")
    if dtype is WireDType.FLOAT64:
        return values.astype("<f8")
    if dtype is WireDType.BFLOAT16:
        bits = values.view(np.uint32)
        # round to nearest even; NaN stays NaN (its high bits keep a set mantissa bit)
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        nan = np.isnan(values)
        out = ((bits + rounding) >> 16).astype(np.uint16)
        if nan.any():
            out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
        return out
    raise InvalidArgument(f"wire dtype {dtype.name} cannot carry values")


def decode(buffer, dtype: WireDType, count: int) -> np.ndarray:
    """Wire bytes (any buffer) -> float32 1-d array of ``count`` values.

    FLOAT32 is zero-copy (a read-only view of ``buffer``); the others allocate the float32 result.
    """
    if dtype is WireDType.FLOAT32:
        return np.frombuffer(buffer, dtype="<f4", count=count)
    if dtype is WireDType.FLOAT16:
        return np.frombuffer(buffer, dtype="<f2", count=count).astype(np.float32)
    if dtype is WireDType.FLOAT64:
        return np.frombuffer(buffer, dtype="<f8", count=count).astype(np.float32)
    if dtype is WireDType.BFLOAT16:
        half = np.frombuffer(buffer, dtype="<u2", count=count)
        return (half.astype(np.uint32) << 16).view(np.float32)
    raise InvalidArgument(f"wire dtype {dtype.name} cannot carry values")
