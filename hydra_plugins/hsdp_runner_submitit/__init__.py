"""hsdp_runner's Hydra launcher plugins (see ``launcher.py``)."""
