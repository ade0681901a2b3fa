"""The embedded default: a small character model trained on text that ships with CPython."""
