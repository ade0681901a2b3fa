"""``python -m benchmarks.swarm``: the pipeline swarm benchmark (issue 29 names it
``benchmarks/swarm.py``), ``pipeline.py``'s ``main`` with the same flags. The family's other
scripts run as their own modules: ``benchmarks.swarm.replicas`` (two replicas per stage against
2-worker DiLoCo) and ``benchmarks.swarm.lanes`` (L pinned lanes against one).

No ``__name__`` guard: this module is only ever run (``-m``), and the smoke list's check of
the family's scripts (tests/processes/test_benchmark_smoke.py) counts modules that carry one.
"""

import sys

from benchmarks.swarm.pipeline import main

sys.argv[0] = "python -m benchmarks.swarm"  # the usage line names what the user typed
main()
