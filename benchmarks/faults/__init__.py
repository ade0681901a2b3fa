"""Fault benchmarks: training while workers and the server are killed with SIGKILL (``chaos``,
``chaos_allreduce``), and kill -9 of the server at each moment of its checkpointing that
matters (``crash_moments``)."""
