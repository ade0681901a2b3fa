"""The benchmarks' library: what every benchmark script shares, one concept a module.

Processes and servers:

* ``processes``: spawned children: one-off jobs (``run_child``, ``ask_child``), the inbox of
  their reports, a round's start with its CPU cost, reaping, environment and profilers;
* ``session``: a hub process (a server, or torchft's lighthouse) and N member processes driven
  one round at a time through barriers, with their RSS polled;
* ``server_child``: a ``DiLoCoServer`` inside a spawned child, steered over a pipe;
* ``server_process``: ``diloco server`` as a child process, killed with SIGKILL and restarted
  on its port (also the tests' server-process helper);
* ``model``: the process-level benchmarks' model (square linear layers), its initial
  parameters, the stand-in for local training, and a checksum;
* ``trials``: in-process training trials (a server and worker threads on the demo model);
* ``source``: which code a run measures (another ``src/``, a snapshot of this one).

Links and measures:

* ``loopback``: the raw-socket limit, the same bytes moved by plain sockets on this machine;
* ``counting_proxy``: a TCP relay that counts every byte into and out of a server process;
* ``shaped_links``: a shaping proxy per worker (token buckets), and the wire time through it;
* ``rss``: resident memory, read inside a process (``ru_maxrss``) and polled from outside;
* ``report``: round summaries, the one table printer (markdown) and the one JSON writer;
* ``smoke``: the ``--smoke`` flag every script takes, and its checks.

The process-level modules import torch only inside the functions that need it: a parent
process that never imports it keeps the fork-before-exec copy of it that every spawned child
briefly is small. Scripts and tests import this package as ``benchmarks.harness`` from the
repository root.
"""
