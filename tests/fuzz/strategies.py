"""Drawing values: hypothesis draws a message's structure, a generator seeded by one draw per
example the fine detail (``pick``); gradients, edge values and byte mutations."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from hypothesis import strategies as st

from shardps.protos.v1 import common_pb2 as pb

if TYPE_CHECKING:
    from tests.fuzz.world import World


def pick(w: "World", n: int, label: str = "") -> int:
    """An index below ``n`` from the example's generator. Hypothesis draws the structure of a
    message (what kind of fault, which table, how many segments); the fine detail (which
    block, id, byte or bit) comes from a generator seeded by one draw per example: it is
    much faster, and draws must not depend on the cluster's state (hypothesis checks that
    the same choices draw the same way; ``n`` often does)."""
    return int(w.rng.integers(max(n, 1)))


def one_of(w: "World", choices: list):
    return choices[pick(w, len(choices))]


def randint(w: "World", low: int, high: int) -> int:
    return low + pick(w, high - low + 1)


def coin(w: "World") -> bool:
    return bool(w.rng.integers(2))


def blob(w: "World", low: int, high: int) -> bytes:
    return w.rng.bytes(randint(w, low, high))


def some(w: "World", choices: list, most: int) -> list:
    return [one_of(w, choices) for _ in range(randint(w, 0, most))]


def seeded(data, w: "World") -> None:
    w.rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), "seed"))


MAX_DENSE_VALUES = 80
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 3e38, 1e-45, 70000.0], np.float32)


def draw_values(w: "World", n: int, nasty: bool) -> np.ndarray:
    """``n`` float32 gradients from a drawn seed (drawing each float through hypothesis costs
    too much time): eighths in [-8, 8), exact in every wire dtype; ``nasty`` ones also hold
    NaN, infinities, signed zeros, subnormals and values that overflow float16."""
    rng = w.rng
    values = rng.integers(-64, 64, n).astype(np.float32) / np.float32(8)
    if nasty and n:
        where = rng.random(n) < 0.3
        values[where] = rng.choice(SPECIALS, int(where.sum()))
    return values


WIRE = [0, pb.FLOAT32, pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16, pb.FLOAT64]
WIRE_BAD = [pb.INT64, 6, 77, -1, 2 ** 31 - 1]
INT64_EDGE = [-(2 ** 63), -1, 2 ** 63 - 1, 2 ** 40, 1000, 999]
CLOCK_EDGE = [-(2 ** 63), -1, 2 ** 63 - 2, 2 ** 40, 1000, 999]


def knob(w: "World", hostile: bool, clean: list, bad: list, label: str = ""):
    """A choice among ``clean`` values, or (hostile requests) among ``clean + bad``."""
    return one_of(w, clean + bad if hostile else clean)


def mutate(data, w: "World", raw: bytes) -> bytes:
    """Flip bits, cut or insert bytes: 1 to 3 times."""
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3), "mutations")):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]), "mutation")
        pos = pick(w, len(raw))
        bit = int(w.rng.integers(8))
        cut = int(w.rng.integers(1, 5))
        insert = w.rng.bytes(int(w.rng.integers(1, 4)))
        if op == "flip" and raw:
            raw[pos] ^= 1 << bit
        elif op == "cut":
            del raw[pos:pos + cut]
        else:
            raw[pos:pos] = insert
    return bytes(raw)
