"""The client library of a shardps cluster: ``PSClient`` and its layers.

* ``client``: ``PSClient``, the facade (the only class most code needs).
* ``admin``: manager calls (jobs, tables, shard map, checkpoints, status, drains).
* ``membership``: join / leave / heartbeats and the exactly-once sequence numbers.
* ``data``: routing, parallel sends, retries and re-routing, decoding of pulls.
* ``transport``: one call to one server (``Transport``; ``GrpcTransport`` with shared memory).
* ``requests``: the data rules of the API's arguments (pure).
"""

from shardps.rpc.stubs import ManagerStub
from shardps.worker.client.admin import parse_consistency
from shardps.worker.client.client import PSClient
from shardps.worker.client.membership import Membership
from shardps.worker.client.results import PullResult, PushResult
from shardps.worker.client.transport import GrpcTransport, Transport

__all__ = ["PSClient", "Membership", "PullResult", "PushResult", "ManagerStub", "parse_consistency",
           "Transport", "GrpcTransport"]
