"""Leave what a process has imported out of the garbage collector's passes.

Modules, classes and functions (torch, the runner, Dynamo, sympy: a few hundred thousand to a
million objects) are never garbage, yet every full collection scans them, and so does the
interpreter's last one at exit. ``gc.freeze`` moves them to a generation no pass visits.
Measured here (torch 2.13, this machine): a process that imports ``hsdp_runner.runtime.app``
and exits takes 2.3 CPU-s, 1.95 with the imports frozen (as little as one that leaves through
``os._exit``); a worker's teardown ``gc.collect()`` took about 0.25 CPU-s a rank.

The imports themselves run the collector too: the heap grows by a quarter million objects, so
its thresholds trip hundreds of passes, a few of them full ones over everything imported so far,
and they find next to nothing (7,431 unreachable objects of 261,264 after importing
``hsdp_runner.runtime.app``). An entry point turns collection off before its imports
(``pause_collection``) and ``freeze_imports`` turns it back on: such an import then takes
1.6 CPU-s instead of 2.0 (three runs each, this machine). The little garbage the imports made is
frozen with the rest and never freed (well under 1% of the process's memory).
"""

from __future__ import annotations

import gc


def pause_collection() -> None:
    """Turn automatic garbage collection off until ``freeze_imports`` (call it before a
    process's imports; every process that calls it must reach ``freeze_imports``, or it never
    collects again). Takes and returns nothing."""
    gc.disable()


def freeze_imports() -> None:
    """Freeze every object this process holds now and turn automatic collection on (call it
    once the imports are done, before the work: what the work makes later is collected as
    usual). Takes and returns nothing."""
    gc.freeze()
    gc.enable()
