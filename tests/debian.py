"""A binary from a Debian package for the tests that run a real one (Prometheus, etcd)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def debian_binary(binary: str, package: str) -> str:
    """The path of ``binary``; installs Debian's ``package`` with apt-get when it is missing
    (root only), else skips the test with the reason."""
    found = shutil.which(binary)
    if found:
        return found
    reason = None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        reason = f"no {binary} binary, and apt-get cannot install one here (not root or no apt-get)"
    else:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "--no-install-recommends", package]
        for attempt in range(2):
            done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode == 0:
                break
            if attempt == 0:          # the package lists may be missing or old
                subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        found = shutil.which(binary)
        if not found:
            reason = f"`apt-get install {package}` failed: {(done.stderr or done.stdout)[-500:]}"
    if not found:
        print(f"skipping: {reason}")
        pytest.skip(reason)
    return found
