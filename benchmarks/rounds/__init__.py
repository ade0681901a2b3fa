"""Round benchmarks on loopback: synchronous rounds against the raw-socket limit
(``sync_round``), the server mode against the all-reduce mode (``allreduce_round``), and the
all-reduce mode against torchft's DiLoCo (``torchft_diloco``)."""
