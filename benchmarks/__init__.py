"""The benchmarks of diloco: a small library and thin scripts that use it.

``harness/`` is the library every benchmark shares (processes, server processes, sessions of
a server and N workers driven a round at a time, memory, the raw-socket limit, the one table
printer and JSON writer). The scripts are grouped by family: ``rounds/`` (a round's time and
memory on loopback, against the raw limit and against torchft), ``faults/`` (kill -9 of
workers and the server), ``links/`` (workers behind slow or shaped links), ``codecs/`` (speed,
error and training quality of the codecs), ``training/`` (training runs: async, streaming,
trainers, compute utilization, worker groups), ``swarm/`` (the demo model as pipeline
stages through a ``--swarm`` coordinator). ``quality/`` is the training-quality suite
(``./dev quality``).

Every script runs from the repository root as a module, e.g.
``.venv/bin/python -m benchmarks.rounds.sync_round --params 100e6 --workers 1 4``, and takes
``--smoke``: a run of a few seconds through the real path that exits 0 only if its figures are
sane (the slow test lane runs them all, ``tests/processes/test_benchmark_smoke.py``).
Figures go to ``docs/benchmarks.md``; the results they come from to ``benchmarks/results/``.
"""
