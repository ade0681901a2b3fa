"""How a worker talks to the server: ``DiLoCoClient`` (every HTTP call, with its timeouts and
retries, and the errors a sync strategy tells apart), the bulk connections that carry tensor
bodies straight from and into memory, and how a server address becomes a URL.

Owns the network, nothing of the model: it imports nothing else of ``diloco.worker``."""
