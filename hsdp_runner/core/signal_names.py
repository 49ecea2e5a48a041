"""Stop-signal names: parsing the one a user writes (``launcher.signal``) and naming a number.

Kept in core because config checks validate ``launcher.signal`` before any process starts,
and the runtime's signal handling below them uses the same rules.
"""

from __future__ import annotations

import signal

# Signals that cannot be caught, or that would hide a real crash; refused for launcher.signal.
UNUSABLE = {"SIGKILL", "SIGSTOP", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL", "SIGCHLD"}


def parse_signal(name: str) -> signal.Signals:
    """Return the signal ``name`` names ('USR2', 'SIGUSR2' or '12'); raise ValueError if none
    or if it cannot serve as a stop signal."""
    text = str(name).strip().upper()
    try:
        sig = (
            signal.Signals(int(text))
            if text.isdigit()
            else signal.Signals["SIG" + text.removeprefix("SIG")]
        )
    except (KeyError, ValueError):
        raise ValueError(f"{name!r} is not a signal name") from None
    if sig.name in UNUSABLE:
        raise ValueError(f"{sig.name} cannot be caught or would hide a crash")
    return sig


def signal_name(signum: int) -> str:
    """'SIGTERM' for 15, and so on."""
    return signal.Signals(signum).name
