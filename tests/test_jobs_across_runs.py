"""A job outlives the run that created it: creating a table it already has is idempotent only
for the same settings, and says what differs otherwise; changing settings on purpose
(update_config) does not break the next run's identical create; a SYNC script run again
goes on from the group's step, and a run that continues a job's tables says so at its start
(real servers on loopback)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from shardps.errors import AlreadyExists
from shardps.server.manager import store
from shardps.server.manager.records import ManagerSettings
from shardps.tables import adagrad, sgd


def _client(cluster, client_factory, job: str, mode: str = "async"):
    c = client_factory(cluster.address, job=job)
    c.create_job(mode)
    return c


def test_creating_a_table_again_with_other_settings_says_what_differs(cluster, client_factory):
    c = _client(cluster, client_factory, "again")
    c.create_sparse("e", 8, num_rows=1000, optimizer=adagrad(0.1))
    c.create_sparse("e", 8, num_rows=1000, optimizer=adagrad(0.1))          # the same: idempotent
    with pytest.raises(AlreadyExists, match=r"created with optimizer=adagrad lr=0.1.*asks for "
                                            r"optimizer=adagrad lr=0.05.*update_config"):
        c.create_sparse("e", 8, num_rows=1000, optimizer=adagrad(0.05))
    with pytest.raises(AlreadyExists, match="optimizer=sgd"):
        c.create_sparse("e", 8, num_rows=1000, optimizer=sgd(0.1))
    assert c.table("e").config.optimizer.lr == pytest.approx(0.1)        # nothing changed


def test_a_table_whose_settings_were_changed_on_purpose_is_created_again_as_before(cluster, client_factory):
    # a restarted worker creates its tables with the settings it was started with, after a
    # learning-rate schedule changed them with update_config
    c = _client(cluster, client_factory, "scheduled")
    c.create_dense("w", (16,), optimizer=sgd(0.1))
    c.update_config("w", lr=0.01)
    c.create_dense("w", (16,), optimizer=sgd(0.1))
    assert c.table("w").config.optimizer.lr == pytest.approx(0.01)       # the schedule's value stays
    with pytest.raises(AlreadyExists, match="lr=0.1"):
        c.create_dense("w", (16,), optimizer=sgd(0.01))


def test_the_stored_manager_state_keeps_the_creation_settings_and_loads_state_without_them(cluster,
                                                                                         client_factory):
    c = _client(cluster, client_factory, "persisted")
    c.create_dense("w", (16,), optimizer=sgd(0.1))
    c.update_config("w", lr=0.01)
    rt = cluster.manager.runtime
    with rt.lock:
        data = store.to_dict(rt.state)
    restored = store.from_dict(data, ManagerSettings(), now=0.0)
    rec = restored.tables[("persisted", "w")]
    assert rec.created is not None and rec.created.optimizer.lr == pytest.approx(0.1)
    assert rec.config.optimizer.lr == pytest.approx(0.01)
    legacy = dict(data, tables=[{k: v for k, v in t.items() if k != "created"} for t in data["tables"]])
    assert store.from_dict(legacy, ManagerSettings(), now=0.0).tables[("persisted", "w")].created is None


def test_a_sync_script_run_again_goes_on_from_the_groups_step(cluster, client_factory):
    for run in range(2):
        c = _client(cluster, client_factory, "sync-again", mode="sync")
        c.create_dense("w", (4,), optimizer=sgd(0.1))
        c.join(heartbeat=False)
        assert c.current_step == 3 * run
        for _ in range(3):
            with c.step():
                c.pull_dense("w")
                c.push_dense("w", np.ones(4, np.float32))
        c.leave()
        c.close()


def test_a_setting_equal_to_its_default_is_named_against_the_one_asked(cluster, client_factory):
    c = _client(cluster, client_factory, "rerun-lr")
    c.create_dense("w", (16,), optimizer=sgd(0.01))              # lr=0.01: sgd's default
    with pytest.raises(AlreadyExists, match=r"created with optimizer=sgd lr=0.01 [^;]*; this call asks for "
                                            r"optimizer=sgd lr=0.5 "):
        c.create_dense("w", (16,), optimizer=sgd(0.5))


def test_a_run_that_continues_a_job_says_so_and_how_to_start_fresh(cluster, client_factory, caplog):
    caplog.set_level(logging.INFO, logger="shardps.client")
    first = _client(cluster, client_factory, "continued")
    assert not [r for r in caplog.records if "continued" in r.getMessage()]       # a new job: nothing said
    first.create_dense("w", (16,), optimizer=sgd(0.1))
    first.join(heartbeat=False)
    second = _client(cluster, client_factory, "continued")              # joins the run in progress
    said = [r for r in caplog.records if "'continued'" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO"] and "is running (1 live workers" in said[0].getMessage()
    for step in range(5):
        first.push_dense("w", np.ones(16, np.float32), clock=step)
    first.leave()
    caplog.clear()
    _client(cluster, client_factory, "continued")                       # the next run
    said = [r for r in caplog.records if "'continued'" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"], said
    assert "exists from an earlier run (5 steps, tables: w): this run continues from its tables' values" \
        in said[0].getMessage()
    assert "shardps job end continued" in said[0].getMessage() and "client.end_job()" in said[0].getMessage()
    second.end_job()
    caplog.clear()
    _client(cluster, client_factory, "continued")                       # ended: a fresh job again
    assert not [r for r in caplog.records if "'continued'" in r.getMessage()]
