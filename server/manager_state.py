"""Compatibility: the names ``server/processes.py`` imports from here. The resource manager's
state lives in ``shardps.server.manager`` (``records.py``, ``state.py``); import from there.
Delete this module once ``server/processes.py`` does."""

from shardps.server.manager.records import ManagerSettings

__all__ = ["ManagerSettings"]
