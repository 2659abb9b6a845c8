"""Hidden-state extraction (stage 03): token-budget batches, the transformers backend, and the writer threads
(the row file itself: common/rows.py)."""
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from common.errors import UserError, is_oom
from common.log import log
from common.rows import row_file, save_row
from common.verifier import load_verifier_weights


def plan_batches(lengths: dict[int, int], max_tokens: int) -> list[list[int]]:
    """Rows sorted longest first, grouped so that rows x longest row (the padded size) <= max_tokens."""
    longest = max(lengths.values())
    if longest > max_tokens:
        raise UserError(f"--max-tokens-per-batch {max_tokens} is smaller than the longest row ({longest} tokens); "
                        f"raise it to at least {longest}")
    batches, current = [], []
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        if current and (len(current) + 1) * lengths[current[0]] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class RowWriter:
    """Writes rows on background threads so disk time overlaps compute.

    On a GPU, states travel to the host through a ring of reusable pinned buffers: the copy is
    asynchronous, and a buffer returns to the ring when its rows are on disk, which also bounds the
    host memory in flight to `buffers` batches.
    """

    def __init__(self, threads: int = 4, buffers: int = 3, capacity: int = 0, dtype=torch.bfloat16,
                 fp8: bool = False):
        self.fp8 = fp8  # quantized on the writer threads, as hs-connectors' fp8 connector does
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="hs-write")
        self.free: queue.Queue = queue.Queue()
        self.slots = threading.Semaphore(buffers)
        self.bytes = 0
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.copy_stream = None
        if capacity and torch.cuda.is_available():  # pinning is slow: do it once, up front
            for _ in range(buffers):
                self.free.put(torch.empty(capacity, dtype=dtype, pin_memory=True))
            self.copy_stream = torch.cuda.Stream()

    def to_host(self, states: torch.Tensor):
        """Copy device states into a free pinned buffer on a side stream, so the next forward runs
        during the copy; returns (host view, buffer, ready event)."""
        buf = self.free.get()  # waits for a write to finish: bounds host memory in flight
        if buf.numel() < states.numel():
            buf = torch.empty(states.numel(), dtype=states.dtype, pin_memory=True)
        host = buf[: states.numel()].view(states.shape)
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            host.copy_(states, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        states.record_stream(self.copy_stream)  # keep its memory until the copy is done
        return host, buf, ready

    def submit(self, jobs: list[tuple], ready=None, on_done=None, buffer=None) -> None:
        """jobs: (path, token_ids, states, loss_mask); `ready` (a CUDA event) is awaited before writing;
        `buffer` goes back to the pinned ring once the rows are written."""
        self.slots.acquire()

        def write():
            if ready is not None:
                ready.synchronize()
            written = sum(save_row(*job, fp8=self.fp8) for job in jobs)
            with self.lock:
                self.bytes += written
            return len(jobs)

        future: Future = self.pool.submit(write)

        def done(f):
            if buffer is not None:
                self.free.put(buffer)
            self.slots.release()
            if f.exception():
                self.errors.append(f.exception())
            elif on_done:
                on_done(f.result())

        future.add_done_callback(done)
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.errors:
            raise self.errors[0]


def decoder_layers(model, num_layers: int) -> torch.nn.ModuleList:
    """The decoder layer list, wherever the architecture keeps it (model.layers, language_model.model.layers, ...)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers and name.endswith("layers"):
            return module
    raise UserError(f"could not find the {num_layers} decoder layers in {type(model).__name__}")


class TransformersBackend:
    """Plain forward of the base model (no lm_head) with hooks on just the layers saved.

    Aux id k is the input of decoder layer k (a pre-hook); the final slot is the last decoder
    layer's output, before the final norm (a forward hook).
    """

    def __init__(self, model, aux_layers: list[int], num_layers: int, device: torch.device):
        self.model, self.device = model.eval(), device
        layers = decoder_layers(self.model, num_layers)
        self.captured: list = [None] * (len(aux_layers) + 1)
        for slot, k in enumerate(aux_layers):
            layers[k].register_forward_pre_hook(self._pre_hook(slot), with_kwargs=True)
        layers[num_layers - 1].register_forward_hook(self._post_hook(len(aux_layers)))

    @classmethod
    def load(cls, verifier: str, aux_layers: list[int], num_layers: int, dtype: str, device: str,
             trust_remote_code: bool = False) -> "TransformersBackend":
        """The base model without its lm_head (its logits are never needed)."""
        from transformers import AutoModel
        kwargs = {"dtype": getattr(torch, dtype), "trust_remote_code": trust_remote_code}
        if device == "auto":  # spread over all visible GPUs: models that do not fit one
            model = load_verifier_weights(AutoModel, verifier, device_map="auto", **kwargs)
            return cls(model, aux_layers, num_layers, torch.device("cuda:0"))
        model = load_verifier_weights(AutoModel, verifier, **kwargs).to(device)
        return cls(model, aux_layers, num_layers, torch.device(device))

    def _pre_hook(self, slot):
        def hook(_module, args, kwargs):
            self.captured[slot] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _post_hook(self, slot):
        def hook(_module, _args, output):
            self.captured[slot] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.no_grad()
    def states(self, rows: list[list[int]], pad_id: int) -> torch.Tensor:
        """[B, T, n_slots, H] bf16 on the model's device for right-padded rows (padding never changes
        earlier positions under a causal mask; callers slice each row to its length)."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        out = torch.stack([t.to(self.device) for t in self.captured], dim=2).to(torch.bfloat16)
        self.captured = [None] * len(self.captured)
        return out


def extract_transformers(backend: TransformersBackend, batches, rows: dict, todo: set, out: str, writer: RowWriter,
                         pad_id: int, on_done) -> None:
    """Run every batch and write its rows that are in `todo`; on out-of-memory split it in two and retry.
    Copies to pinned host memory are asynchronous, so the next forward starts while this batch travels
    to the disk."""
    on_gpu = backend.device.type == "cuda"
    queue = list(batches)
    while queue:
        batch = queue.pop(0)
        try:
            states = backend.states([rows[i]["input_ids"] for i in batch], pad_id)
        except Exception as e:
            if not is_oom(e):
                raise
            if len(batch) == 1:
                raise UserError(f"out of memory on a single row of {len(rows[batch[0]]['input_ids'])} tokens; "
                                "lower --max-seq-len in stage 01, or use more GPUs (--device auto) or a bigger host")
            log.warning(f"out of memory on a batch of {len(batch)} rows; splitting it in two and retrying")
            backend.captured = [None] * len(backend.captured)
            if on_gpu:
                torch.cuda.empty_cache()
            queue[:0] = [batch[: len(batch) // 2], batch[len(batch) // 2:]]
            continue
        ready = buffer = None
        if on_gpu:
            states, buffer, ready = writer.to_host(states)
        jobs = [(row_file(out, i), rows[i]["input_ids"], states[b, : len(rows[i]["input_ids"])], rows[i]["loss_mask"])
                for b, i in enumerate(batch) if i in todo]
        writer.submit(jobs, ready, on_done, buffer)
