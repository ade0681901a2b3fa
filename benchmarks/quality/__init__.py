"""The training-quality suite (issue 20): named experiments that test the DiLoCo papers' claims
through the real server and workers, results as JSON, and ``docs/quality.md`` rendered from them.

    python benchmarks/quality/run.py                 # every experiment, seeds 0 1 2, then render
    python benchmarks/quality/run.py scaling --fast  # one experiment, its fast setting
    python benchmarks/quality/render.py              # docs/quality.md from the JSON files

Modules: ``protocol`` (profiles, data splits, schedule, pretrain cache, baselines without a
server), ``experiments`` (one named experiment per claim or group of claims), ``run`` (the CLI),
``claims`` (the claims table's figures and verdicts) and ``render`` (tables and plots).
"""
