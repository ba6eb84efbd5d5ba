"""Logging: human-readable lines on a terminal, JSON lines with ``--log-format json``.

Every line carries the process's context (role, node, job, rank, epoch) from a ``LogContext``
that the process updates as it learns them. Tokens and payloads are never logged: nothing
in shardps passes them to a logger, and ``redact`` masks anything that looks like a bearer
token in a message.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_TOKEN_RE = re.compile(r"(?i)(bearer\s+|token[=:]\s*)[A-Za-z0-9._~+/=-]{8,}")
CONTEXT_FIELDS = ("role", "node", "job", "rank", "epoch")


def redact(text: str) -> str:
    return _TOKEN_RE.sub(lambda m: m.group(1) + "<redacted>", text)


class LogContext(logging.Filter):
    """Adds the process's context fields to every record. Update with ``set(**fields)``."""

    def __init__(self, **fields):
        super().__init__()
        self.fields = {k: "" for k in CONTEXT_FIELDS}
        self.fields.update({k: v for k, v in fields.items() if v is not None})

    def set(self, **fields) -> None:
        self.fields.update({k: v for k, v in fields.items() if v is not None})

    def filter(self, record: logging.LogRecord) -> bool:
        for k, v in self.fields.items():
            if not hasattr(record, k):
                setattr(record, k, v)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for k in CONTEXT_FIELDS:
            v = getattr(record, k, "")
            if v not in ("", None):
                entry[k] = v
        if record.exc_info:
            entry["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry, separators=(",", ":"))


class HumanFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ctx = " ".join(f"{k}={getattr(record, k)}" for k in CONTEXT_FIELDS
                       if getattr(record, k, "") not in ("", None))
        line = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} [{ctx}] {redact(record.getMessage())}"
        if record.exc_info:
            line += "\n" + redact(self.formatException(record.exc_info))
        return line


class StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record comes, not the stream it
    was at set-up: a thread that logs late (a kernel warm-up) then never writes to a stream
    that was swapped out and closed (pytest's capture of an in-process command)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup(role: str, node: str = "", fmt: str = "auto", level: str = "info", stream=None) -> LogContext:
    """Configure the root logger once for this process; returns the context to update.
    Records go to ``stream``, else to the process's ``sys.stderr`` of the moment."""
    handler = logging.StreamHandler(stream) if stream is not None else StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else HumanFormatter())
    context = LogContext(role=role, node=node)
    handler.addFilter(context)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    return context
