"""A reply's payload as the buffers that carried it (``Payload``): what a transport hands the
data path to read pulled values from."""

from __future__ import annotations

from shardps.errors import Unavailable


class Payload:
    """The data of a pull response as the buffers that carried it, read in order without
    assembling them first: a read inside one buffer is zero-copy, ``read_into`` copies
    pieces straight into the caller's array. Not thread-safe (one reader)."""

    def __init__(self, pieces: list):
        self.pieces = pieces
        self.total = sum(len(p) for p in pieces)
        self._i = 0
        self._pos = 0
        self.consumed = 0

    def __len__(self) -> int:
        return self.total

    def read(self, n: int):
        """The next ``n`` bytes (a memoryview; a copy only when they span two buffers)."""
        if n == 0:
            return memoryview(b"")
        piece = self.pieces[self._i] if self._i < len(self.pieces) else memoryview(b"")
        if self._pos + n <= len(piece):
            out = piece[self._pos:self._pos + n]
            self._advance(n)
            return out
        out = bytearray(n)
        self.read_into(memoryview(out))
        return memoryview(out)

    def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` with the next bytes; raises Unavailable if the payload is short."""
        filled, n = 0, len(dest)
        while filled < n:
            if self._i >= len(self.pieces):
                raise Unavailable(f"pull payload ended {n - filled} bytes short")
            piece = self.pieces[self._i]
            take = min(n - filled, len(piece) - self._pos)
            dest[filled:filled + take] = piece[self._pos:self._pos + take]
            filled += take
            self._advance(take)

    def _advance(self, n: int) -> None:
        self._pos += n
        self.consumed += n
        while self._i < len(self.pieces) and self._pos >= len(self.pieces[self._i]):
            self._pos -= len(self.pieces[self._i])
            self._i += 1
