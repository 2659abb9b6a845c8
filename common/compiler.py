"""torch.compile of the draft's forward on a thread of its own, beside the first eager steps (04 --compile)."""
import threading
import time

import torch

from common.log import log


class Compiler:
    """torch.compile of the draft's forward, run once on the first batch on a thread of its own while
    the loop goes on with eager steps; the loop switches to the compiled forward when it is built.
    A cold compile takes tens of seconds (docs/benchmarks.md): without this, silent time before the first
    step that looks like a hang. Its one forward runs beside the eager steps, so GPU memory may peak near
    both. `wait` compiles before the first step instead."""

    def __init__(self, model, call, wait: bool, announce: bool):
        self.model, self.call, self.wait, self.announce = model, call, wait, announce
        self.eager, self.compiled = model.forward, torch.compile(model.forward)
        self.thread, self.error, self.started, self.installed = None, None, 0.0, False

    def _build(self, batch):
        try:
            if batch["input_ids"].is_cuda:  # the current GPU is per thread
                torch.cuda.set_device(batch["input_ids"].device)
            # Forward only, with the backward compiled at once rather than at its first call: running a
            # backward here would read parameters that the loop's optimizer has since updated in place.
            # (Where torch lacks the switch, the loop's first compiled backward compiles it.)
            config = torch._functorch.config  # noqa: SLF001
            eager_bw = {"force_non_lazy_backward_lowering": True} if hasattr(config, "force_non_lazy_backward_lowering") else {}
            with config.patch(eager_bw):
                self.call(self.compiled, batch)
        except Exception as e:  # noqa: BLE001 - reported by finish(); training goes on eager
            self.error = e

    def start(self, batch, step: int):
        if self.started:
            return
        self.started = time.time()
        self.thread = threading.Thread(target=self._build, args=(batch,), daemon=True, name="compile")
        self.thread.start()
        if self.wait:
            self.finish(step)

    def finish(self, step: int, block: bool = True, last: bool = False) -> None:
        """Install the compiled forward, once it is built (waited for if `block`), for the steps after `step`;
        after the `last` step, only let the thread end."""
        if self.installed or not self.started or (not block and self.thread.is_alive()):
            return
        self.thread.join()
        self.installed = True
        if self.error is not None:
            log.warning(f"torch.compile failed ({type(self.error).__name__}: {str(self.error).splitlines()[0][:300]}); "
                        "training goes on with the eager forward")
            return
        if last:
            if self.announce:
                log.info(f"torch.compile took {time.time() - self.started:.1f}s, longer than the run: all its steps were eager")
            return
        self.model.forward = self.compiled
        from torch._dynamo.utils import compile_times
        took = dict(zip(*compile_times(repr="csv", aggregate=True)))
        if self.announce:
            log.info(f"compiled forward in use from step {step + 1}: torch.compile took {time.time() - self.started:.1f}s "
                     f"({float(took.get('_compile.compile_inner', 0)):.1f}s tracing and compiling the forward, "
                     f"{float(took.get('compile_fx.<locals>.bw_compiler', 0)):.1f}s the backward)")
