"""Readers of finished runs: the runs table, predicted vs measured, W&B reports and the
compare dashboard."""
