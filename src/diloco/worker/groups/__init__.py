"""Worker groups: the ranks of a ``torch.distributed`` group are ONE DiLoCo worker. Rank 0
talks to the server through whichever strategy ``worker/choose.py`` picked; every rank enters
the same collectives at the same steps (``Lockstep``, ``GroupSync``). Owns the group and its
agreement check (``WorkerGroup``), the parameters' broadcast, gather and scatter, and small
JSON values carried in tensor collectives.

Never imports ``server_mode/`` or ``allreduce/``: it wraps any ``SyncStrategy``."""
