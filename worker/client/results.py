"""What the servers answered to a data call, as the client returns it: ``PushResult``,
``PullResult`` and the block versions both carry (``BlockVersions``). Plain values."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from shardps.messages import Versions


class BlockVersions(Mapping):
    """(table, block) -> version, from the ``Versions`` of a call's replies: kept as they
    came and made a dict only when read (a step's replies carry a version per block of every
    table it touched, hundreds, which are rarely read)."""

    def __init__(self):
        self._replies: list[Versions] = []
        self._dict: dict[tuple[str, int], int] | None = None

    def extend(self, versions: list[Versions]) -> None:
        """Keep a reply's ``versions`` (read only when the mapping is)."""
        if versions:
            self._replies += versions
            self._dict = None

    def _pairs(self) -> dict[tuple[str, int], int]:
        if self._dict is None:
            self._dict = {}
            for v in self._replies:
                self._dict.update(version_pairs(v))
        return self._dict

    def __getitem__(self, key: tuple[str, int]) -> int:
        return self._pairs()[key]

    def __iter__(self):
        return iter(self._pairs())

    def __len__(self) -> int:
        return len(self._pairs())

    def __repr__(self) -> str:
        return f"BlockVersions({self._pairs()!r})"


@dataclass
class PushResult:
    """What the servers acknowledged for one push."""

    versions: BlockVersions = field(default_factory=BlockVersions)      # (table, block) -> version
    duplicate_blocks: int = 0          # blocks that had already applied this push (a retry)
    clock: int = 0                     # the clock the push carried


@dataclass
class PullResult:
    """The values of one pull (in request order) and what the servers said about them."""

    values: list[np.ndarray]
    versions: BlockVersions                                             # (table, block) -> version
    min_clock: int = 0                 # the group's slowest completed step, largest over servers
    clock: int = 0                     # the clock the pull carried (this worker's completed steps)
    waited_seconds: float = 0.0        # longest a server held the pull for stragglers (SYNC/SSP)
    staleness: int = 0                 # clock - a server's min_clock, worst server (SYNC/SSP)


def take_pull_reply(result: PullResult, min_clock: int, waited_seconds: float, versions: list[Versions],
                    in_group: bool, dense: set[str], seen: dict[tuple[str, int], int]) -> None:
    """One server's answer to a pull, into ``result`` (both ways of pulling call this): the
    group's clock, the wait, the staleness and the versions; the versions of ``dense``
    tables also into ``seen`` (the versions a dense push sends back as its base). The
    staleness counts where the group has a clock: the server reported one, or the pull came
    from a member or client of the group (``in_group``: its header had a session), whose
    group has then completed no step yet."""
    result.min_clock = max(result.min_clock, int(min_clock))
    result.waited_seconds = max(result.waited_seconds, waited_seconds)
    if min_clock or in_group:
        result.staleness = max(result.staleness, max(0, result.clock - int(min_clock)))
    result.versions.extend(versions)
    if dense:
        for v in versions:
            if v.table in dense:
                seen.update(version_pairs(v))


def version_pairs(v: Versions) -> dict[tuple[str, int], int]:
    """(table, block) -> version of one reply's ``Versions``."""
    blocks = v.blocks.tolist() if hasattr(v.blocks, "tolist") else v.blocks
    versions = v.versions.tolist() if hasattr(v.versions, "tolist") else v.versions
    return dict(zip(zip(itertools.repeat(v.table), blocks), versions))
