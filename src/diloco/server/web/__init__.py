"""The HTTP layer: the aiohttp app and its routes (``app.py``, ``control.py``), which parse a
request, call the mode's front and write the reply; the security guard, connection limits,
bodies read from the socket, the stall guard, JSON bodies, log limiting, the counters only HTTP
sees, and the dashboard's static files (``dashboard/``).

Talks to a mode only through ``server/front.py``'s protocol: it imports no front and none of the
parts behind one (rounds, intake, members, allreduce, paramserver), only the records it renders
(``observe/``) and the snapshot type a download streams (``params/store.py``).
"""
