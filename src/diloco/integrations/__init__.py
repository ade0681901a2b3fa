"""Trainer integrations: ``diloco.integrations.transformers`` (Hugging Face ``Trainer``) and
``diloco.integrations.lightning`` (``lightning.Trainer``), each a callback around
``DiLoCoWorker``. Importing this package imports neither library; each module needs its extra
(``pip install -e '.[transformers]'`` or ``'.[lightning]'`` in the diloco checkout; README,
"Install")."""
