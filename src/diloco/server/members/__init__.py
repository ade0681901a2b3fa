"""Workers as members of a run, the same in every mode: the registry, membership (registering,
leaving, heartbeats, DyLU, kicks, the expected count, evicting silent, stuck and never-joined
workers), the codec a registering worker asks for, and the fragmenting every worker must agree
on. What membership means to a mode is its ``Roster`` (``membership.py``).

Imports nothing of the server but its config and errors: both fronts use it, and it uses
neither.
"""
