"""The sync strategy of a server in all-reduce mode: the workers hold the run's state and
average among themselves, the server only forms a quorum per round.

``QuorumSync`` is the one quorum loop (ask, connect, resync, contribute, average, commit, step,
report, save, re-register); what a round averages and when one is due is its payload
(``payload.py``): the whole model (``WholeModel``) or one fragment per round, overlapped with
training (``FragmentRounds``). The server's refusals set the worker's ``Standing``. Below
them: the quorum's process group and its collectives (``QuorumCollective``), the checks of its
average, its connect, and the shared state with its checkpoint.

Never imports ``server_mode/`` or ``groups/``; ``worker/choose.py`` builds it."""
