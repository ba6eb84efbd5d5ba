"""One etcd member on loopback for manager replicas (the verifier's ``--managers``, and the
manager-HA tests): Debian's ``etcd`` binary (package ``etcd-server``), probed free ports, its
data and log in a work directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from shardps.errors import ShardpsError
from shardps.server.manager.etcd_store import EtcdClient


def find_etcd() -> str:
    """The etcd binary on PATH; FileNotFoundError saying how to get one."""
    found = shutil.which("etcd")
    if not found:
        raise FileNotFoundError("no etcd binary on PATH: install Debian's etcd-server "
                                "(apt-get install etcd-server) or run without --managers")
    return found


class EtcdProcess:
    """One etcd member on loopback, its data in ``work``, answering when constructed (a
    probed port taken by another process before etcd bound it is probed again). ``stop()``
    kills it."""

    ATTEMPTS = 5

    def __init__(self, binary: str, work: Path, timeout: float = 30.0):
        self.log_path = work / "etcd.log"
        try:
            for _ in range(self.ATTEMPTS):
                self._launch(binary, work)
                if self._serving(timeout):
                    return
                self.client.close()
            raise RuntimeError(f"etcd found no free port in {self.ATTEMPTS} tries: "
                               f"{self.log_path.read_text()[-2000:]}")
        except BaseException:          # a TimeoutError, Ctrl-C, ...: no etcd left without its owner
            if hasattr(self, "popen"):
                self.stop()
            raise

    def _launch(self, binary: str, work: Path) -> None:
        from shardps.tools.bench.common import free_port
        shutil.rmtree(work / "etcd-data", ignore_errors=True)     # nothing of a try that failed
        self.client_port, peer = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{self.client_port}"
        cmd = [binary, "--name", "ha", "--data-dir", str(work / "etcd-data"),
               "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
               "--listen-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-cluster", f"ha=http://127.0.0.1:{peer}",
               "--max-txn-ops", "10000", "--max-request-bytes", str(8 << 20)]
        if shutil.which("setpriv"):       # dies with its parent even if that is killed
            cmd = ["setpriv", "--pdeathsig", "TERM", "--"] + cmd
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.client = EtcdClient(self.endpoint)

    def _serving(self, timeout: float) -> bool:
        """True once it answers; False if it exited because a port was taken; raises else."""
        try:
            self.wait_ready(timeout)
            return True
        except RuntimeError:
            if "address already in use" in self.log_path.read_text():
                return False
            raise

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"etcd exited: {self.log_path.read_text()[-2000:]}")
            try:
                self.client.get("/ready-probe")
                return
            except ShardpsError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd did not answer within {timeout:g}s: "
                                       f"{self.log_path.read_text()[-2000:]}") from None
            time.sleep(0.1)

    def leader(self, prefix: str) -> str:
        """The address in ``prefix``'s leader key ("" when none)."""
        value = self.client.get(f"{prefix.rstrip('/')}/leader")
        return json.loads(value)["address"] if value else ""

    def stop(self) -> None:
        self.client.close()
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)
