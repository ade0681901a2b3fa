"""Trainer integrations: ``diloco.integrations.transformers`` (Hugging Face ``Trainer``) and
``diloco.integrations.lightning`` (``lightning.Trainer``), each a callback around
``DiLoCoWorker``. Importing this package imports neither library; each module needs its extra
(``pip install 'diloco[transformers]'``, ``pip install 'diloco[lightning]'``)."""
