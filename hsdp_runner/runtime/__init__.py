"""Running jobs: the Hydra app, the checks before any worker starts, the launcher (local
workers, torchrun, SLURM), parallel=auto's planning process, one worker's life and one rank's
training, the forkserver and the reaper, sweeps, stop signals, failure records and the rank-0
sidecar."""
