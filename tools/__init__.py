"""shardps.tools: what runs the library rather than what it is made of: the ``shardps``
command (``cli``), ``shardps local`` (``local``, ``local_run``), ``shardps run``
(``launch``), development certificates (``devcerts``), the benchmark (``bench``), the
fault-schedule verifier (``verify``) and a network proxy for partition tests (``netproxy``).
They import the library (``shardps``, ``shardps.server``, ``shardps.worker``); nothing in the
library imports them (``tests/test_imports.py``)."""
