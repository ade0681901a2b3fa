"""What a worker holds, whatever its strategy: the model and its fp32 snapshot of the global
parameters (``LocalModel``), how a download lands in them (adopted as it arrives, or as a
compressed downlink's update applied to the snapshot), and how a pseudo-gradient leaves them
(``UploadEncoder``: the codec and its error-feedback residual), and the state a checkpoint
gives a worker to start from in all-reduce and swarm mode (``StartState``).

No strategy is known here: it imports only itself and ``transport/`` of ``diloco.worker``."""
