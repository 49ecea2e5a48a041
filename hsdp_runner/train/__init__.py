"""One rank's training: the trainer, data, the loss, gradient clipping, what a step's end
costs (step_end), fixed run figures, metrics, tensor memory, profiling and the sinks
(metrics.jsonl, summary.json, W&B)."""
