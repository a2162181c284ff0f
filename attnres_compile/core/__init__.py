"""What every format shares: the options (`config.AttnResConfig`), the errors and their exit codes,
the neutral graph view (graph_view.py), chain analysis (chain_analysis.py) and the plan it returns
(plan.py), the two-phase grouping policy (two_phase.py), verification (verify.py), the report
(report.py) and the checks every front door makes (checks.py). Nothing here imports the rest."""

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it here)
