"""Pipeline swarm benchmarks (issue 29): the demo's character model cut into stages, peers
joined through a real ``--swarm`` coordinator (``pipeline``)."""
