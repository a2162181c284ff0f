"""The study's arms: which train AttnRes, which are converted from a trained baseline, and their labels
(shared by study_report.py and study_plots.py)."""

ATTNRES_ARMS = ("full", "block", "full-preserve", "block-preserve", "full-paper", "block-paper")
CONVERTED = ("full-preserve", "block-preserve", "full-paper", "block-paper")
LABEL = {"baseline": "baseline (scratch)", "full": "Full, paper (scratch)", "block": "Block, paper (scratch)",
         "continue": "baseline, continued", "full-preserve": "-> Full, preserve", "block-preserve": "-> Block, preserve",
         "full-paper": "-> Full, paper", "block-paper": "-> Block, paper"}
