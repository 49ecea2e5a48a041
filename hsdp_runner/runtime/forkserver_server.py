"""Imported only inside multiprocessing's forkserver, which ``forkserver.use_server`` names as
its preload: it readies the server every worker is forked from (``forkserver.prepare_server``).
"""

from hsdp_runner.runtime.forkserver import prepare_server

prepare_server()
