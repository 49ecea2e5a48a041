"""The bottom layer: every Enum choice (job status too), exit codes, the records a job
writes (RunInfo, RunSummary), the user-facing errors, fault injection and stop-signal names.
Imports nothing of the package above it."""
