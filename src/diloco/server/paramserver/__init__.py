"""The parameter server's front (sync, async, streaming fragments): the ``Coordinator``
(``coordinator.py``), which builds the parts and routes each request to the one that owns it,
its side of membership (``roster.py``), downloads (``downloads.py``), and where it starts from
(``startup.py``: a checkpoint, initial parameters, or nothing).

Only ``server/server.py`` imports it; it never imports all-reduce mode's front.
"""
