"""The edge of every HTTP server the project runs (the server, a swarm peer's stage service):
what a stranger can hold before it shows the token is bounded here (connections in all and per
address, the request head's deadline: ``connections.py``), and logs that strangers could make
flood the disk are rate-limited (``log_limit.py``). Imports only aiohttp and the standard
library, so both sides use it without importing each other."""
