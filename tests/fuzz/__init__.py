"""Hostile input: random and mutated messages to every RPC of a running manager and servers.

The fuzzers send every request as raw bytes through identity serializers (so nothing on the
client side tidies it up), every call with a deadline, to in-process clusters on loopback.
The tests are ``tests/test_fuzz_worker_rpcs.py`` and ``tests/test_fuzz_admin_rpcs.py``; the
failures they found, reduced to a few requests, are ``tests/test_fuzz_regressions.py``.

* ``wire.py``       the RPCs, the documented status codes, ``Wire`` (sends, records outcomes),
                    ``KNOWN_BUGS`` (failures tolerated until fixed; none is open)
* ``encoder.py``    the wire encoding, written independently of the library
* ``reference.py``  the reference model of the data job (``Reference``, ``Verdict``)
* ``world.py``      the fuzzed cluster (``World``), rounds of examples, the final state check
* ``strategies.py`` drawing values: seeded detail, gradients, edge values, byte mutations
* ``data_path.py``  Push, Pull, ProbeSharedMemory: drawn, sent, judged by the reference
* ``manager_rpcs.py``   ResourceManager requests
* ``internal_rpcs.py``  server-to-server and manager-to-server requests
* ``admin.py``      admin RPCs with every kind of credential
* ``cross_job.py``  every entry of the authorization table (``shardps.authz``) with another
                    job's token, on gRPC and the data plane (``tests/test_authz_fuzz.py``)

Hypothesis runs from fixed seeds, without shrinking and without a database: the same
messages are sent on every run.
"""
