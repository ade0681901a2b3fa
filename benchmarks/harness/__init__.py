"""The benchmarks' library: what every benchmark script shares, one concept a module.

Processes and servers:

* ``processes``: spawned children: one-off jobs (``run_child``, ``ask_child``), the inbox of
  their reports, a round's start with its CPU cost, reaping, environment and profilers;
* ``session``: a hub process (a server, torchft's lighthouse, the raw-socket server) and N
  member processes driven one round at a time through barriers, with their RSS polled; a
  configuration's run over one (its rounds, a kill inside one, the phases' medians);
* ``server_child``: a ``DiLoCoServer`` inside a spawned child, steered over a pipe;
* ``server_process``: ``diloco server`` as a child process, killed with SIGKILL and restarted
  on its port (also the tests' server-process helper);
* ``model``: the process-level benchmarks' model (square linear layers), how a run names and
  records it, its initial parameters, the stand-in for local training, and a checksum;
* ``trials``: in-process training trials (a server and worker threads on the demo model), the
  fields a sweep's trials share and its rows by configuration;
* ``source``: which code a run measures (another ``src/``, a snapshot of this one).

Links and measures:

* ``loopback``: the raw-socket limit, the same bytes moved by plain sockets on this machine (a
  session that polls no RSS);
* ``counting_proxy``: a TCP relay that counts every byte into and out of a server process;
* ``shaped_links``: a shaping proxy per worker (token buckets), and the wire time through it;
* ``rss``: resident memory, read inside a process (``ru_maxrss``) and polled from outside, and
  whether a run fits in the memory available;
* ``report``: round summaries, the one table printer (markdown) and the cells the round tables
  share, a run's heading and the head of its results file, the one JSON writer;
* ``smoke``: the ``--smoke`` flag every script takes, and its checks.

The process-level modules import torch only inside the functions that need it: a parent
process that never imports it keeps the fork-before-exec copy of it that every spawned child
briefly is small. Scripts and tests import this package as ``benchmarks.harness`` from the
repository root.
"""
