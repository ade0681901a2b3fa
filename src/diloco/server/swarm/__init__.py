"""Swarm mode's coordinator (``--swarm``): stage assignment, the stages' tables, the route
table and suspect reports (``stage_book.py``), behind the server's ``Front``
(``swarm_front.py``). The peers' side is ``diloco.swarm``."""
