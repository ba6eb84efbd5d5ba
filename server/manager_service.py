"""Compatibility: the names ``server/processes.py`` imports from here. The resource manager
lives in ``shardps.server.manager`` (see its ``__init__``); import from there. Delete this
module once ``server/processes.py`` does."""

from shardps.server.manager.checkpoints import CheckpointCoordinator
from shardps.server.manager.runtime import ManagerRuntime, RuntimeSettings
from shardps.server.manager.service import SERVICE, ResourceManagerService

__all__ = ["SERVICE", "CheckpointCoordinator", "ManagerRuntime", "ResourceManagerService", "RuntimeSettings"]
