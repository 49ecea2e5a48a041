"""The typed config: schema dataclasses (Hydra structured configs), composition and the
checks that run before any worker starts."""
