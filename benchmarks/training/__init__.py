"""Training runs: heterogeneous workers in the async modes (``async_experiment``), streaming
fragments (``streaming_experiment``), the Hugging Face Trainer callback (``trainer_quality``),
compute utilization behind slow links (``compute_utilization``), and worker groups
(``group_sync``)."""
