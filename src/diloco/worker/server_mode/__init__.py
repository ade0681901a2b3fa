"""The sync strategies of a parameter server (sync and async modes): ``PlainSync`` (the whole
model every ``sync_every`` steps) and ``StreamingSync`` (one fragment at a time, overlapped with
training: its plan and schedule, and the background thread that carries each fragment), and
how either joins and re-joins the server (seeding, the first download, the rebase).

Never imports ``allreduce/`` or ``groups/``; ``worker/choose.py`` picks a strategy from here."""
