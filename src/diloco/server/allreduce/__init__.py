"""All-reduce mode's front (``allreduce_front.py``): the workers average among themselves and the
server holds no parameters. It forms one quorum per round and records its outcome
(``quorum_book.py``, consulting ``waiting.py``, ``quorum_records.py``, ``agreement.py``,
``suspects.py``, ``leaves.py`` and ``exclusions.py``), checks each registration's
parameter table (``run_table.py``) and hosts the rendezvous the quorums meet at
(``rendezvous.py``).

Shares the members and the status with the parameter server; never imports its parts
(``rounds/``, ``intake/``, ``params/``, ``paramserver/``).
"""
