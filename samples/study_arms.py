"""The study's arms: which train AttnRes from scratch, which are converted from a trained baseline, and their
labels (shared by study.py, study_report.py and study_plots.py)."""

FROM_SCRATCH = ("full", "block", "delta-block", "delta")  # AttnRes arms from scratch, each in its published form
CONVERTED = ("full-preserve", "block-preserve", "full-paper", "block-paper")
ATTNRES_ARMS = FROM_SCRATCH + CONVERTED
LABEL = {"baseline": "baseline (scratch)", "full": "Full, paper (scratch)", "block": "Block, paper (scratch)",
         "delta-block": "Delta-Block, paper init (scratch)", "delta": "Delta, paper init (scratch)",
         "continue": "baseline, continued", "full-preserve": "-> Full, preserve", "block-preserve": "-> Block, preserve",
         "full-paper": "-> Full, paper", "block-paper": "-> Block, paper"}
