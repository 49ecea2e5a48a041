"""The runner's exit codes, shared by the launcher, sweeps and parity.

0: every rank finished; 1: a rank failed; 2: bad input, found before any worker started;
128 + N: stopped by signal N (an interrupted job or sweep).
"""

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
