"""The worker's progress bar, on a terminal, shows how many steps there are and how long is
left (a real `shardps worker` under a pseudo-terminal)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

pytestmark = pytest.mark.slow          # a process (shardps worker), ~10 s


def test_the_progress_bar_shows_the_total_and_an_eta(make_cluster, tmp_path):
    cluster = make_cluster(1)
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))    # a terminal's width
    proc = subprocess.Popen([sys.executable, "-m", "shardps.tools.cli", "worker", "--manager", cluster.address,
                             "--name", "w0", "--job", "bar", "--device", "cpu", "--model", "digits-cnn",
                             "--steps", "40"],
                            stdin=follower, stdout=follower, stderr=follower, cwd=tmp_path, close_fds=True)
    os.close(follower)
    out = b""
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:             # the worker exited and closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=60) == 0, out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    text = out.decode(errors="replace")
    # tqdm with a total: "12/40 [00:01<00:03, ...]": the count of the total and the time left
    assert re.search(r"\b\d+/40 \[\d\d:\d\d<\d\d:\d\d", text), text[-2000:]
