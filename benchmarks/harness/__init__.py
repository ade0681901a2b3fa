"""What the process-level benchmarks share, one concept a module.

* ``processes``: spawned children driven one round at a time (their message inbox, the round
  start with its CPU cost, reaping, environment and profilers around a spawn);
* ``rss``: resident memory, read inside a process (``ru_maxrss``) and polled from outside;
* ``loopback``: the raw-socket limit, the same bytes moved by plain sockets on this machine;
* ``report``: the summaries, markdown tables and JSON the benchmarks print and write.

Modules here import torch only inside the functions that need it: a parent process that never
imports it keeps the fork-before-exec copy of it that every spawned child briefly is small.
Scripts in ``benchmarks/`` import this package as ``harness`` (their directory is on the path).
"""
