"""Regional relay servers (``diloco server --upstream HOST:PORT``): a sync parameter server
that is itself one worker of an upstream server. Its front (``front.py``) is the parameter
server's with the relay's aggregator (``aggregator.py``: a closed round's mean goes upstream
instead of into an outer step) and the link to the upstream (``upstream.py``: joining, seeding,
heartbeats, one exactly-once upload per round). docs/design/relay.md has the design."""
