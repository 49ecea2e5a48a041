"""One rank's training: the trainer, data, fixed run figures, metrics, tensor memory,
profiling and the tracking sinks (metrics.jsonl, summary.json, W&B)."""
