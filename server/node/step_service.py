"""The data plane's Step frames on a server node: a frame's header read (``shardps.rpc.step``),
the caller's job checked, its arrays bound to the frame's payload or to the job's
shared-memory region, the node's ``step`` run, and the reply's header written. What
``ParameterServerService.data_plane`` does for Push, Pull and Exchange, with less Python per
request (``DataPlaneServer`` calls ``StepService.frame`` straight from its connection loop).
"""

from __future__ import annotations

import time

import numpy as np

from shardps import authz, names
from shardps.errors import InvalidArgument, ResourceExhausted, ShardpsError
from shardps.rpc import step, step_reply
from shardps.rpc.frames import FLAG_PACKED
from shardps.rpc.shm import ServerRegions
from shardps.rpc.status import grpc_code
from shardps.server.auth import check_job
from shardps.server.node.node import ServerNode

SERVICE = "shardps.v1.ParameterServer"
_RULE = authz.TABLE[SERVICE]["Step"]
MAX_REGIONS = 8         # shared-memory regions a connection keeps mapped
# a pull's reply values of this size go into a buffer its connection keeps (a new array of
# many MiB costs a page fault per 4 KiB each time); up to MAX_SCRATCH
MIN_SCRATCH, MAX_SCRATCH = 1 << 20, 256 << 20


class StepService:
    """Serves Step frames for ``node``. Thread-safe (per-connection state is the caller's)."""

    def __init__(self, node: ServerNode, regions: ServerRegions, admission, refused):
        self.node = node
        self.regions = regions
        self.admission = admission
        self.refused = refused          # refused(error): the refusal metrics

    def frame(self, header: memoryview, payload: memoryview, principal, state: dict, deadline, flags: int):
        """``DataPlaneServer``'s step handler: (reply header, payload buffers) of one Step
        frame. ``state`` is the connection's: the job it was last checked for (the token is
        checked on every frame: it may be revoked) and the regions it keeps mapped. Counted
        in the ``grpc_server_*`` metrics as data-plane calls are (batched)."""
        started = time.perf_counter()
        code = "OK"
        try:
            if not flags & FLAG_PACKED:
                raise InvalidArgument("Step: the header travels in the packed form only (flag PACKED, 4)")
            request, region, layout = step.read_request(header)
            job = request.header.job
            if state.get("job") != (job, principal):       # the same job as last time on this connection
                authz.check_scope(_RULE, principal, request)
                names.check(names.JOB, job, "header.job")
                state["job"] = (job, principal)
            check_job(principal, job)
            if region is not None:
                payload, out = self._region(region, job, payload, state)
            else:                       # the reply's values in a buffer the connection keeps
                out = state.get("scratch")
            limit = self.node.limits.max_request_bytes
            if len(payload) > limit:
                raise ResourceExhausted(f"Step: {len(payload)} bytes; the limit max_request_bytes is {limit}: "
                                        f"split the request")
            step.bind(request, layout, payload)
            if self.admission.enabled:
                with self.admission.admit(job, len(payload)):
                    reply = self.node.step(request, deadline, out)
            else:
                reply = self.node.step(request, deadline, out)
            pulled = reply.pull
            if pulled is None:
                return step_reply.reply(reply, request, False), ()
            if region is None:
                if pulled.in_shared_memory:         # written into the scratch buffer: sent from there
                    pulled.in_shared_memory = False
                    return step_reply.reply(reply, request, False), [out[:pulled.payload_bytes]]
                if MIN_SCRATCH <= pulled.payload_bytes <= MAX_SCRATCH:
                    state["scratch"] = np.empty(pulled.payload_bytes, np.uint8)     # for the next ones
            return step_reply.reply(reply, request, pulled.in_shared_memory), reply.values
        except ShardpsError as exc:
            code = grpc_code(exc).name
            self.refused(exc)
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            self.node.metrics.observe_call(SERVICE, "Step", code, time.perf_counter() - started)

    def _region(self, region: step.Region, job: str, payload, state: dict):
        """(payload, reply buffer) of a Step whose bulk bytes are in shared memory: views of
        the job's region. The connection keeps the mapping while ``ServerRegions`` keeps the
        region bound to the job (checked on every frame: a dict read)."""
        if len(payload):
            raise InvalidArgument(f"Step: the payload is in shared memory; the frame carries {len(payload)} "
                                  f"payload bytes")
        regions = state.setdefault("regions", {})
        key = (region.name, job)
        mapped = regions.get(key)
        if mapped is None or mapped.shape[0] < region.end or not self.regions.bound(region.name, job):
            mapped = np.frombuffer(self.regions.view_for(region.name, 0, region.end, job), np.uint8)
            if len(regions) >= MAX_REGIONS:
                regions.clear()
            regions[key] = mapped
        size = mapped.shape[0]
        if region.payload_offset + region.payload_bytes > size or region.reply_offset + region.reply_bytes > size:
            raise InvalidArgument(f"Step: shared-memory ranges beyond region {region.name!r} ({size} bytes)")
        payload = mapped[region.payload_offset:region.payload_offset + region.payload_bytes]
        out = mapped[region.reply_offset:region.reply_offset + region.reply_bytes] if region.reply_bytes else None
        return payload, out
