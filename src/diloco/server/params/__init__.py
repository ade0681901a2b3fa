"""The global parameters as the parameter server publishes them: the store (one contiguous fp32
payload that downloads stream from, copy-on-write, checksummed), a round published as it is
written (``publication.py``), the wake-ups of its waiters, a lossy downlink's update bodies
(``update_bodies.py``), and initial parameters read from a file.

Knows nothing of units, rounds or workers: imports nothing of the server but its config and
errors.
"""
