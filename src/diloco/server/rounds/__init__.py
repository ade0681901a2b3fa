"""The parameter server's rounds: the model cut into units (``model.py``, ``units.py``), each unit's
``Aggregator`` (``aggregator.py``: sync rounds behind a barrier, async updates behind a gate),
what an aggregator uses to make an outer step (``outer_steps.py``), publication with the
checkpoint it may owe (``checkpoints.py``), and the admission of a submission from its metadata
(``submissions.py``).

Never imports the web layer, the intake, a front (``paramserver/``, ``allreduce/``): the
coordinator hands each part the others' callbacks.
"""
