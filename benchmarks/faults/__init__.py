"""Fault benchmarks: training while workers and the server are killed with SIGKILL (``chaos``,
``chaos_allreduce``), and kill -9 of the server at each moment of its checkpointing that
matters (``crash_moments``). The goodput benchmark (``benchmarks/goodput.py``) is built here:
its schedule (``goodput_schedule``), a configuration's run (``goodput_run``) and its worker
program (``goodput_worker``), the reached-steps ledger (``step_ledger``) and the data-parallel
baseline's model (``dataparallel_model``)."""
