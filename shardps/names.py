"""The rules for names a client sends: one per kind, checked at the RPC boundary.

A name that a request carries may end up in a file path (checkpoints), a shared-memory name,
a Prometheus label or a log line. Each servicer checks every such field here, before anything
changes, and refuses a bad one with ``InvalidArgument`` naming the field, the value and the
rule. Every kind shares one shape:

    [A-Za-z0-9][A-Za-z0-9._-]*   at most MAX_LENGTH[kind] characters, no ".."

so a name is never empty, never "." or "..", never hidden (leading dot) nor an option
(leading dash), and carries no separator ("/", "\\"), NUL, space, newline or non-ASCII
character. Whole-string matches only: a trailing newline is refused too.

======================  ==========  ==========================================================
kind                    max length  used as
======================  ==========  ==========================================================
job                     64          checkpoint directory ``<root>/<job>/``, metric labels, logs,
                                    the first part of job tokens ``<job>.<nonce>.<mac>``
table                   128         checkpoint file ``tables/<table>.safetensors``, labels
checkpoint id           128         checkpoint directory ``<root>/<job>/<id>/``
worker name             128         the group's member list, logs (optional: may be empty)
server name             128         labels, logs, the ring (host and pod names fit)
======================  ==========  ==========================================================

Directories in admin calls (``Checkpoint.directory``, ``Restore.path``) follow a separate
rule, ``inside_root``: relative ones are taken under the manager's checkpoint root, and the
result, symbolic links resolved, must lie inside that root.

Names are checked where they are created, wherever the manager is told a job's name, and by
the servers' job-level RPCs (ProbeSharedMemory, HoldJob, DropTables). Lookups alone are not
refused: a table named against the rule cannot exist (tables created before this rule stay
reachable), and Push and Pull only look their job and tables up in the shard map, whose
names were checked when they were created, before anything is recorded under them.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardps.errors import FailedPrecondition, InvalidArgument

_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
RULE = "[A-Za-z0-9][A-Za-z0-9._-]*, no '..'"

JOB, TABLE, CHECKPOINT_ID, WORKER, SERVER = "job", "table", "checkpoint id", "worker name", "server name"
MAX_LENGTH = {JOB: 64, TABLE: 128, CHECKPOINT_ID: 128, WORKER: 128, SERVER: 128}


def is_valid(kind: str, name: str) -> bool:
    return (isinstance(name, str) and len(name) <= MAX_LENGTH[kind]
            and _SHAPE.fullmatch(name) is not None and ".." not in name)


def check(kind: str, name: str, field: str) -> str:
    """``name`` if it follows the rule of ``kind``; InvalidArgument naming ``field`` otherwise."""
    if not is_valid(kind, name):
        raise InvalidArgument(f"{field}={name!r} is not a valid {kind}: use 1-{MAX_LENGTH[kind]} "
                              f"characters matching {RULE}")
    return name


def check_optional(kind: str, name: str, field: str) -> str:
    """Like ``check``, but the empty string (meaning "not given") passes."""
    return name if name == "" else check(kind, name, field)


def inside_root(value: str, root: str, field: str) -> Path:
    """The directory ``value`` of an admin call, resolved inside the checkpoint ``root``.

    Empty: the root itself. Relative: taken under the root. Absolute: must already lie
    inside it. ``..`` and symbolic links are resolved first. Raises FailedPrecondition when
    no root is configured, InvalidArgument naming ``field`` when the result leaves it."""
    if not root:
        raise FailedPrecondition(f"{field}={value!r}: the manager has no checkpoint root: start "
                                 f"it with --checkpoint-dir (directories are taken inside it)")
    if "\0" in value:
        raise InvalidArgument(f"{field}={value!r}: a path cannot contain NUL")
    base = Path(root).resolve()
    resolved = (base / value).resolve() if value else base
    if not resolved.is_relative_to(base):
        raise InvalidArgument(f"{field}={value!r} resolves to {str(resolved)!r}, outside the "
                              f"checkpoint root {str(base)!r}: give a directory inside it")
    return resolved
