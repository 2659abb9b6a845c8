"""How a stage fails and stops: bad input (UserError), a stop signal (Stopped, the signal handlers), out of memory."""
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # besides Ctrl-C (SIGINT)


class UserError(Exception):
    """Bad input from the user: reported as one line, exit code 2, no traceback."""


class Stopped(Exception):
    """A run stopped by a signal after saving what it had: one line saying how to resume, exit 128 + signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def interrupt_on_stop_signals() -> None:
    """SIGTERM (a scheduler, `kill`) and SIGHUP (a dropped ssh session) stop a stage as Ctrl-C does:
    KeyboardInterrupt(signum), which the stage wrapper reports in one line."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signum)
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # under nohup SIGHUP is ignored, and the run goes on
            signal.signal(sig, interrupt)


def catch_stop_signals() -> list:
    """SIGTERM, SIGHUP and Ctrl-C are noted in the returned list instead: a training loop stops at its next
    step, with a checkpoint."""
    caught: list = []
    for sig in (*STOP_SIGNALS, signal.SIGINT):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: caught.append(signum))
    return caught


def is_oom(e: BaseException) -> bool:
    """Out of memory on the GPU (CUDA's error) or on the host (the CPU allocator's, or Python's)."""
    import torch
    text = str(e).lower()
    return (isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text
            or "can't allocate memory" in text)
