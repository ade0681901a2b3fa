"""What the server shows: the typed status (``status.py``, from its records in ``records.py``),
``/metrics`` (``metrics.py``), the run log the aggregators and the intake append to, and the
loss history.

Reads either front through ``status.Observed``; imports no front and none of the parts behind
one, only the registry and the store's type.
"""
