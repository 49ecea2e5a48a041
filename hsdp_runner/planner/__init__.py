"""Predicting memory and step time of every layout from one CPU process: the layouts and
their degrees, parallel=auto's choice, memory (and its phases), step time (and its compute
part per precision), pipeline layouts, the cluster and its links, the link micro-benchmark,
calibration and the report."""
