"""Logging and progress for a person tailing a log file under nohup."""
import logging
import os
import resource
import sys
import time

log = logging.getLogger("eagle3")
LAUNCH = time.time()  # imported first by every stage: the time a launch is counted from


def setup_logging(stage: str, log_file: str | None = None) -> None:
    """Timestamped lines to stdout (line-buffered) and, if given, to a log file."""
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except AttributeError:
        pass
    fmt = logging.Formatter(f"%(asctime)s {stage} %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    log.handlers.clear()
    rank = int(os.environ.get("RANK", 0))  # under torchrun, rank 0 speaks for the run; the others warn only
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False
    handlers = [logging.StreamHandler(sys.stdout)]
    if log_file and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    if not sys.stdout.isatty():  # library progress bars would flood a tailed log
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
    for h in handlers:
        h.setFormatter(fmt)
        log.addHandler(h)


def fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m}m{s}s" if h else (f"{m}m{s}s" if m else f"{s}s")


def fmt_bytes(n: float) -> str:
    """1.2 GB, 340 MB, 12 kB: enough digits to tell two sizes apart at any scale."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def memory_summary() -> str:
    """Peak host RSS and, if a GPU is in use, peak GPU memory."""
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
    text = f"rss_peak {rss_gb:.1f}GB"
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            text += f" gpu_peak {torch.cuda.max_memory_allocated() / 1e9:.1f}GB"
    except ImportError:
        pass
    return text


class Progress:
    """done/total with rate and ETA: a tqdm bar on a terminal, a plain line every few seconds otherwise.

    `extra` is a callable returning more text for the line (GB written, loss, ...).
    """

    def __init__(self, total: int, unit: str = "rows", every: float = 5.0, extra=None, desc: str = ""):
        self.total, self.unit, self.every, self.extra, self.desc = total, unit, every, extra, desc
        self.done = 0
        self.start = self.last = time.time()
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit=unit, desc=desc)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            if self.extra:
                self.bar.set_postfix_str(self.extra())
            return
        now = time.time()
        if now - self.last >= self.every or self.done >= self.total:
            self.last = now
            log.info(self.line())

    def line(self) -> str:
        elapsed = max(time.time() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_s = fmt_duration(eta) if eta != float("inf") else "?"
        text = f"{self.desc + ' ' if self.desc else ''}{self.done}/{self.total} {self.unit} {rate:.2f} {self.unit}/s eta {eta_s}"
        if self.extra:
            text += " " + self.extra()
        return text + " " + memory_summary()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
