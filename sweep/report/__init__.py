"""Summary tables and report.html of a sweep, from its run directories or from its Optuna study.

    python -m sweep.report outputs/sweeps/<date>/<time>   # tables on stdout, report.html there

One module per job:
- runs.py       the runs table (one row per run) from run directories; metrics.csv for curves
- study.py      the same runs table from the ledger (an Optuna study)
- tables.py     divergence map, frontier, lr sensitivity, toggle effects, root causes, diagnoses, errors
- marginal.py   the rule that marks a stable run far worse than its combination's best lr `marginal`
- noise.py      the quality column, replicates' spread and ties
- target.py     the machine a recommendation is for: what it cannot run, what costs least on it
- registry.py   every summary table registered once: its builder, title, note, CSV and HTML needs
- recommend.py  the one-line recommendation, backed by table rows
- summary.py    every registered table of a sweep, computed once
- text.py       terminal text, Markdown, and the summary files of a sweep directory
- html.py       report.html (plotly, self-contained); figures.py its plots that go with a table
"""
