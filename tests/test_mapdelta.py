"""Shard maps sent as changes (shardps.mapdelta): applying the changes to the old map gives
the new map exactly, whole and filtered to one job, for random maps and random changes, and
for the maps the manager's own state publishes through a join, a death and its repair."""

from __future__ import annotations

import random

import pytest

from shardps import mapdelta
from shardps.errors import InvalidArgument
from shardps.protos.v1 import common_pb2 as pb
from shardps.tables import Consistency, TableConfig, sgd, sparse_table


def _random_map(rng: random.Random, epoch: int) -> dict:
    """A plain description of a map: servers by name, tables by (job, name), groups."""
    servers = {f"s{i:02d}": ("SERVING", 1) for i in rng.sample(range(40), rng.randint(3, 8))}
    names = sorted(servers)
    tables = {}
    for j in range(rng.randint(1, 3)):
        for k in range(rng.randint(1, 3)):
            blocks = [(rng.sample(names, 2), epoch, epoch) for _ in range(rng.randint(1, 12))]
            tables[(f"job{j}", f"t{k}")] = {"lr": 0.1, "blocks": blocks}
    groups = {f"job{j}": [f"w{r}" for r in range(rng.randint(0, 3))] for j in range(3) if rng.random() < 0.8}
    return {"epoch": epoch, "servers": servers, "tables": tables, "groups": groups}


def _mutate(rng: random.Random, m: dict) -> dict:
    """The next epoch: some of joins, deaths, moved blocks, new, dropped and reconfigured
    tables, group changes (what the manager publishes, at random)."""
    epoch = m["epoch"] + rng.randint(1, 3)
    servers = dict(m["servers"])
    tables = {k: {"lr": v["lr"], "blocks": [(list(r), s, f) for r, s, f in v["blocks"]]}
              for k, v in m["tables"].items()}
    groups = {k: list(v) for k, v in m["groups"].items()}
    if rng.random() < 0.4:                               # a join: shifts later indexes
        servers[f"s{rng.randrange(40):02d}x"] = ("SERVING", 1)
    live = sorted(n for n, (st, _) in servers.items() if st == "SERVING")
    if rng.random() < 0.4 and len(live) > 3:             # a death: promote, re-replicate
        dead = rng.choice(live)
        servers[dead] = ("DEAD", servers[dead][1])
        live.remove(dead)
        for t in tables.values():
            for i, (reps, _, fresh) in enumerate(t["blocks"]):
                if dead in reps:
                    reps = [r for r in reps if r != dead]
                    reps.append(rng.choice([n for n in live if n not in reps]))
                    t["blocks"][i] = (reps, epoch, fresh)
    if rng.random() < 0.3:                               # a restart: new incarnation
        name = rng.choice(sorted(servers))
        servers[name] = ("SERVING", servers[name][1] + 1)
    if rng.random() < 0.2 and len(servers) > 6:          # a retired server leaves the list
        gone = rng.choice(sorted(servers))
        if not any(gone in reps for t in tables.values() for reps, _, _ in t["blocks"]):
            del servers[gone]
            live = [n for n in live if n != gone]
    for t in tables.values():                            # balancing moves
        for i, (_, _, fresh) in enumerate(t["blocks"]):
            if rng.random() < 0.1:
                t["blocks"][i] = (rng.sample(live, 2), epoch, fresh)
    if rng.random() < 0.3:
        tables[(f"job{rng.randrange(4)}", f"n{epoch}")] = {
            "lr": 0.1, "blocks": [(rng.sample(live, 2), epoch, epoch) for _ in range(rng.randint(1, 5))]}
    if rng.random() < 0.2 and tables:
        del tables[rng.choice(sorted(tables))]
    if rng.random() < 0.2 and tables:
        tables[rng.choice(sorted(tables))]["lr"] = 0.5
    if rng.random() < 0.3:
        groups[f"job{rng.randrange(4)}"] = [f"w{r}" for r in range(rng.randint(0, 4))]
    if rng.random() < 0.2 and groups:
        del groups[rng.choice(sorted(groups))]
    return {"epoch": epoch, "servers": servers, "tables": tables, "groups": groups}


def _message(m: dict) -> pb.ShardMap:
    """``m`` as the manager publishes it (ManagerState.shard_map's order)."""
    from shardps.rpc.convert import config_to_proto, consistency_to_proto, spec_to_proto
    msg = pb.ShardMap(epoch=m["epoch"], replication=2)
    names = sorted(m["servers"])
    index = {n: i for i, n in enumerate(names)}
    for n in names:
        state, incarnation = m["servers"][n]
        msg.servers.add(name=n, address=f"{n}:7071", incarnation=incarnation, state=getattr(pb, state))
    for (job, name), t in sorted(m["tables"].items()):
        spec = sparse_table(name, 4, num_blocks=len(t["blocks"]))
        tp = msg.tables.add(job=job, spec=spec_to_proto(spec),
                            config=config_to_proto(TableConfig(optimizer=sgd(t["lr"]))))
        for reps, since, fresh in t["blocks"]:
            tp.blocks.add(replicas=[index[r] for r in reps], since_epoch=since, fresh_epoch=fresh)
    for job, members in sorted(m["groups"].items()):
        g = msg.groups.add(job=job, consistency=consistency_to_proto(Consistency.ASYNC, 0))
        for rank, w in enumerate(members):
            g.members.add(rank=rank, session=f"{job}-{w}", incarnation=1, name=w)
    return msg


@pytest.mark.parametrize("seed", range(40))
def test_applying_the_changes_gives_the_new_map_whole_and_for_each_job(seed):
    rng = random.Random(seed)
    m = _random_map(rng, 1)
    for _ in range(12):
        n = _mutate(rng, m)
        old, new = _message(m), _message(n)
        changes = mapdelta.diff(old, new)
        assert changes.HasField("changes") and not changes.servers and not changes.tables
        assert mapdelta.apply(old, changes) == new
        for job in ("job0", "job1", "job2", "job3"):
            mine = mapdelta.changes_only_job(changes, job)
            assert mapdelta.apply(mapdelta.only_job(old, job), mine) == mapdelta.only_job(new, job)
            assert all(tc.job == job for tc in mine.changes.tables)
        m = n


def test_changes_are_small_and_unchanged_maps_cost_nothing():
    rng = random.Random(7)
    m = _random_map(rng, 1)
    m["tables"] = {("job0", "big"): {"lr": 0.1, "blocks": [
        (rng.sample(sorted(m["servers"]), 2), 1, 1) for _ in range(5000)]}}
    old = _message(m)
    victim = sorted(m["servers"])[0]
    m2 = {**m, "epoch": 2, "servers": {**m["servers"], victim: ("DEAD", 1)}}
    m2["tables"] = {k: {"lr": v["lr"], "blocks": [
        ([r for r in reps if r != victim], 2, f) if victim in reps else (reps, s, f)
        for reps, s, f in v["blocks"]]} for k, v in m["tables"].items()}
    new = _message(m2)
    changes = mapdelta.diff(old, new)
    moved = sum(victim in reps for reps, _, _ in m["tables"][("job0", "big")]["blocks"])
    assert len(changes.changes.tables[0].block_indexes) == moved
    assert changes.ByteSize() < new.ByteSize() * moved / 5000 * 2 + 200
    assert mapdelta.apply(old, changes) == new
    same = mapdelta.unchanged(new)
    assert same.ByteSize() < 16 and mapdelta.apply(new, same) == new


def test_changes_refuse_a_base_of_another_epoch_and_changes_that_do_not_fit():
    rng = random.Random(3)
    m = _random_map(rng, 5)
    old = _message(m)
    new = _message(_mutate(rng, m))
    changes = mapdelta.diff(old, new)
    other = pb.ShardMap()
    other.CopyFrom(old)
    other.epoch = 4
    with pytest.raises(mapdelta.StaleBase, match="from epoch 5 cannot be applied to epoch 4"):
        mapdelta.apply(other, changes)
    bad = pb.ShardMap()
    bad.CopyFrom(changes)
    tc = bad.changes.tables.add(job="nojob", table="missing")
    tc.block_indexes.append(0)
    tc.blocks.add()
    with pytest.raises(InvalidArgument, match="does not have"):
        mapdelta.apply(old, bad)
    bad = mapdelta.unchanged(old)
    bad.changes.server_names.extend(["s99"])
    with pytest.raises(InvalidArgument, match=r"name servers \['s99'\]"):
        mapdelta.apply(old, bad)


def test_the_managers_maps_through_a_join_a_death_and_its_repair():
    """The manager's own state (ManagerState, as the placement simulation drives it)."""
    from shardps.tools.bench.placement_sim import build_state
    st, _ = build_state(6, 300)
    maps = [st.shard_map()]
    st.register_server("server-0006", "new:1", "", "boot", now=1.0)       # shifts nothing: last
    st.register_server("server-0002a", "new:2", "", "boot", now=1.0)      # shifts later indexes
    maps.append(st.shard_map())
    st.commit_moves(st.plan_moves(), 1.0)
    maps.append(st.shard_map())
    for name, rec in st.servers.items():
        if name != "server-0003":
            st.server_heartbeat(name, rec.incarnation, st.epoch, {}, now=2.0)
    assert st.expire(now=4.0) == ["server:server-0003"]
    maps.append(st.shard_map())
    st.commit_moves(st.plan_moves(), 4.0)
    maps.append(st.shard_map())
    for old, new in zip(maps, maps[1:]):
        changes = mapdelta.diff(old, new)
        assert mapdelta.apply(old, changes) == new
        assert changes.ByteSize() < new.ByteSize()
        assert mapdelta.apply(mapdelta.only_job(old, "sim"), mapdelta.changes_only_job(changes, "sim")) \
            == mapdelta.only_job(new, "sim")
