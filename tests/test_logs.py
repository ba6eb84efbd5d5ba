"""Logging set-up: records go to the process's stderr of the moment, so a thread that logs
after a test swapped stderr out and closed it (pytest's capture of an in-process command)
writes no "--- Logging error ---"."""

from __future__ import annotations

import io
import logging
import sys

from shardps import logs


def test_records_follow_sys_stderr_even_after_the_stream_at_set_up_closed(monkeypatch):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        captured = io.StringIO()
        monkeypatch.setattr(sys, "stderr", captured)
        logs.setup("test", "n0")
        logging.getLogger("shardps.test").info("first")
        captured.close()                               # as pytest closes a test's capture
        later = io.StringIO()
        monkeypatch.setattr(sys, "stderr", later)
        monkeypatch.setattr(logging, "raiseExceptions", True)
        logging.getLogger("shardps.test").info("late")  # a warm-up thread's line, after the test
        assert "[role=test node=n0] late" in later.getvalue()
    finally:
        root.handlers[:], root.level = saved
