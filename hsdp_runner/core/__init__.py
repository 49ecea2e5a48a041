"""The bottom layer: every Enum choice (job status too), exit codes, the records a job
writes (RunInfo, RunSummary), the user-facing errors and fault injection. Imports nothing
of the package above it."""
