"""Running jobs: the Hydra app, the launcher (local workers, torchrun, SLURM), one worker's
life, the forkserver, sweeps, stop signals, failure records and the rank-0 sidecar."""
