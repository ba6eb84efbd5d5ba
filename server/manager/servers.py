"""Server membership: registration, incarnations, heartbeats, leases, draining, retirement.

Functions of (``ManagerState``, arguments, ``now``); no I/O, no clock of their own. Each one
that changes the published map bumps the epoch once (``ManagerState.bump``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shardps.errors import FailedPrecondition, InvalidArgument, NotFound
from shardps.server.manager.moves import remove_from_blocks
from shardps.server.manager.records import ServerRecord, ServerState

if TYPE_CHECKING:
    from shardps.server.manager.state import ManagerState

log = logging.getLogger("shardps.manager")


def register_server(st: ManagerState, name: str, address: str, metrics_address: str, boot_id: str,
                    now: float) -> ServerRecord:
    """Register (or re-register) a server node; see ResourceManager.RegisterServer."""
    if not name or not address:
        raise InvalidArgument(f"server name {name!r} and address {address!r} are both required")
    rec = st.servers.get(name)
    if rec is not None and rec.boot_id == boot_id and rec.live:
        rec.address, rec.metrics_address, rec.last_heartbeat = address, metrics_address, now
        return rec      # a retried registration of the same process
    if rec is None:
        rec = ServerRecord(name, address, metrics_address, incarnation=1, boot_id=boot_id,
                           last_heartbeat=now)
        st.servers[name] = rec
        log.info("server %s registered at %s (incarnation 1)", name, address)
    else:
        # A restart under the same name, or a fenced node coming back: it holds nothing
        # it may serve until blocks are copied to it again.
        if rec.live:
            remove_from_blocks(st, name, now)
        rec.incarnation += 1
        rec.address, rec.metrics_address, rec.boot_id = address, metrics_address, boot_id
        rec.state, rec.last_heartbeat, rec.installed_epoch = ServerState.JOINING, now, 0
        rec.retired = False
        log.warning("server %s re-registered (incarnation %d): its old blocks are fenced",
                    name, rec.incarnation)
    st.bump()
    return rec


def server_heartbeat(st: ManagerState, name: str, incarnation: int, epoch: int, stats: dict,
                     now: float) -> None:
    rec = st.servers.get(name)
    if rec is None:
        raise NotFound(f"server {name!r} is not registered: register first")
    if rec.retired and rec.incarnation == incarnation:
        return
    if rec.incarnation != incarnation or not rec.live:
        raise FailedPrecondition(
            f"server {name!r} incarnation {incarnation} is fenced (current "
            f"{rec.incarnation}, state {rec.state.name}): drop state and register again")
    rec.last_heartbeat = now
    rec.installed_epoch = epoch
    for k in ("primary_blocks", "backup_blocks", "bytes"):
        setattr(rec, k, int(stats.get(k, getattr(rec, k))))
    if rec.state is ServerState.JOINING and epoch > 0:
        rec.state = ServerState.SERVING     # it has installed a map: it serves
        st.bump()


def drain_server(st: ManagerState, name: str) -> int:
    rec = st.servers.get(name)
    if rec is None or not rec.live:
        raise NotFound(f"server {name!r} is not a live server (known: {sorted(st.servers)})")
    if rec.state is not ServerState.DRAINING:
        if len(st.candidates()) <= 1:
            raise FailedPrecondition(f"cannot drain {name!r}: it is the only server left")
        rec.state = ServerState.DRAINING
        st.bump()
    return sum(1 for t in st.tables.values() for b in t.blocks if name in b.replicas)


def expire_servers(st: ManagerState, now: float) -> list[str]:
    """Declare dead every live server whose lease expired (its blocks promote their next
    replica). Does not bump the epoch: the caller does, once for everything that expired."""
    changed = []
    for rec in st.servers.values():
        if rec.live and now - rec.last_heartbeat > st.settings.server_lease_seconds:
            log.warning("server %s lease expired (%.1fs since heartbeat): declared dead",
                        rec.name, now - rec.last_heartbeat)
            remove_from_blocks(st, rec.name, now)
            rec.state = ServerState.DEAD
            changed.append(f"server:{rec.name}")
    return changed


def retire_drained(st: ManagerState) -> list[str]:
    """Draining servers that hold no block anymore are retired (state DEAD)."""
    retired = []
    for rec in st.servers.values():
        if rec.state is ServerState.DRAINING and not any(
                rec.name in b.replicas for t in st.tables.values() for b in t.blocks):
            rec.state, rec.retired = ServerState.DEAD, True
            retired.append(rec.name)
    if retired:
        st.bump()
    return retired
