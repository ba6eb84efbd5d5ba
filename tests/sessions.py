"""A client session for raw-protocol tests: every GRADIENT push carries one (common.proto,
RequestHeader), so a test that sends pushes by hand opens one as any client would."""

from __future__ import annotations

import itertools

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.rpc import channels
from shardps.rpc.stubs import ManagerStub


class ClientSession:
    """A session from ``JoinWorkerGroup(client=True)`` and its push sequence numbers."""

    def __init__(self, manager: str, job: str, metadata=(), tls=None):
        ch = channels.manager_channel(manager, tls)
        try:
            resp = ManagerStub(ch).JoinWorkerGroup(mg.JoinWorkerGroupRequest(job=job, client=True),
                                                   timeout=10, metadata=metadata)
        finally:
            ch.close()
        self.job, self.session, self.incarnation = job, resp.session, resp.incarnation
        self._sequence = itertools.count(1)

    def header(self, epoch: int, **fields) -> pb.RequestHeader:
        """A push header of this session with the next sequence number (``fields`` override)."""
        values = dict(job=self.job, epoch=epoch, session=self.session, incarnation=self.incarnation,
                      sequence=next(self._sequence))
        values.update(fields)
        return pb.RequestHeader(**values)
