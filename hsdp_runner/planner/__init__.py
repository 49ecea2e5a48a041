"""Predicting memory and step time of every layout from one CPU process: memory, step
time, the cluster and its links, the link micro-benchmark, calibration and the report."""
