"""Stage 04's data: extracted rows packed into training sequences, read ahead into pinned buffers.

Batches are packed by speculators' own sampler and laid out exactly as its shift_batch and CollateFn
lay them out (tests/test_train.py checks this), so our loop trains what its trainer trains.
"""
import math
import os
import queue
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from hs_connectors.fp8_utils import dequantize_fp8_tensor

from common.errors import UserError
from common.data import load_prepared
from common.manifest import extracted_from, find_stage_dirs, read_manifest, sha256_json
from common.rows import SAFETENSORS_DTYPES, SCALES, check_row_file, read_prefix, row_file, safetensors_header


def pack_layout(takes: list[int], starts, out: np.ndarray) -> None:
    """Where each shifted token of a pack comes from: shifted token k of row j pairs the aux states at raw position
    start_j + k with the token, loss mask and last-layer state at start_j + k + 1 (out[0]); its position (out[1])
    and its row within the pack (out[2])."""
    if takes:
        out[0] = np.concatenate([np.arange(s, s + t) for s, t in zip(starts, takes)])
        out[1] = np.concatenate([np.arange(1, t + 1) for t in takes])
        out[2] = np.repeat(np.arange(len(takes)), takes)


class PackedBatches:
    """Packed training sequences of extracted rows, in speculators' layout (its shift_batch, then
    its CollateFn: rows shifted by one token, concatenated, cut and zero-padded to max_len).

    Rows are read by `threads` threads straight into a ring of pinned host buffers, copied to the
    device whole and laid out there: its DataLoader path makes five host copies of each batch, which
    measured slower than the training step itself (docs/benchmarks.md).
    """

    def __init__(self, files, lengths, n_aux: int, hidden: int, max_len: int, device, dtype, threads: int,
                 buffers: int = 3):
        self.files, self.lengths, self.n_aux, self.hidden = files, lengths, n_aux, hidden
        self.max_len, self.device, self.dtype = max_len, device, dtype
        with open(files[0], "rb") as f:
            self.file_dtype = SAFETENSORS_DTYPES[safetensors_header(f)[0]["hidden_states"]["dtype"]]
        self.fp8 = self.file_dtype == torch.float8_e4m3fn  # 03 --hidden-states-dtype fp8: per-token scales beside
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="rows-read")
        self.free: queue.Queue = queue.Queue()
        for _ in range(buffers):
            self.free.put(None)  # buffers are made on first use, sized to the batch

    def _plan(self, rows: list[int]):
        """Which rows, and how many shifted tokens of each, fit in max_len."""
        plan, used = [], 0
        for r in rows:
            take = min(self.lengths[r], self.max_len - used)
            if take <= 0:
                break
            plan.append((r, take))
            used += take
        return plan

    def _buffer(self, old, raw_tokens: int):
        if old is not None and old["states"].shape[0] >= raw_tokens:
            if old["release"] is not None:
                old["release"].synchronize()  # its last copy to the device is done
            return old
        pin = self.device.type == "cuda"
        cap = max(raw_tokens, self.max_len + 64)
        return {"states": torch.empty(cap, self.n_aux + 1, self.hidden, dtype=self.file_dtype, pin_memory=pin),
                "ids": torch.empty(cap, dtype=torch.int64, pin_memory=pin),
                "mask": torch.empty(cap, dtype=torch.int64, pin_memory=pin),
                "layout": torch.empty(3, self.max_len, dtype=torch.int64, pin_memory=pin), "release": None,
                **({"scales": torch.empty(cap, 1, 1, dtype=torch.float32, pin_memory=pin)} if self.fp8 else {})}

    def _fill(self, rows: list[int]):
        plan = self._plan(rows)
        buf = self._buffer(self.free.get(), sum(take + 1 for _, take in plan))
        starts = np.cumsum([0] + [take + 1 for _, take in plan])
        def read(job):
            (row, take), start = job
            part = slice(start, start + take + 1)
            read_prefix(self.files[row], {"hidden_states": buf["states"][part], "token_ids": buf["ids"][part],
                                          "loss_mask": buf["mask"][part],
                                          **({SCALES: buf["scales"][part]} if self.fp8 else {})})
        list(self.pool.map(read, zip(plan, starts)))
        takes = [take for _, take in plan]
        n = sum(takes)
        # written into the pinned buffer: a copy from pageable memory would make the host wait for the GPU every step
        pack_layout(takes, starts, buf["layout"][:, :n].numpy())
        return buf, int(starts[-1]), n

    def _recycle(self, buf) -> None:
        self.free.put(buf)

    def _assemble(self, buf, raw: int, n: int) -> dict:
        dev, L = self.device, self.max_len
        states = buf["states"][:raw].to(dev, non_blocking=True)
        ids, mask = buf["ids"][:raw].to(dev, non_blocking=True), buf["mask"][:raw].to(dev, non_blocking=True)
        src, pos, doc = buf["layout"][:, :n].to(dev, non_blocking=True)
        if self.fp8:  # dequantized on the device, as hs-connectors' FP8Transfer does
            states = dequantize_fp8_tensor(states, buf["scales"][:raw].to(dev, non_blocking=True), self.dtype)
        if dev.type == "cuda":  # the host buffer may be refilled once these copies are done
            buf["release"] = torch.cuda.Event()
            buf["release"].record()

        def padded(values, fill=0):
            out = torch.full((1, L, *values.shape[1:]), fill, dtype=values.dtype, device=dev)
            out[0, :n] = values
            return out
        return {"hidden_states": padded(states[src, :self.n_aux].flatten(1).to(self.dtype)),
                "verifier_last_hidden_states": padded(states[src + 1, self.n_aux].to(self.dtype)),
                "input_ids": padded(ids[src + 1]), "loss_mask": padded(mask[src + 1]),
                "position_ids": padded(pos), "document_ids": padded(doc, -1), "tokens": n}

    def __call__(self, batches: list[list[int]]):
        """Yield each batch of row indices as device tensors; the next batches are read meanwhile."""
        pending: queue.Queue = queue.Queue(maxsize=1)
        stop = threading.Event()

        def produce():
            try:
                for rows in batches:
                    if stop.is_set():
                        return
                    pending.put(self._fill(rows))
                pending.put(None)
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                pending.put(e)

        producer = threading.Thread(target=produce, daemon=True, name="rows-pack")
        producer.start()
        try:
            while (item := pending.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                batch = self._assemble(*item)
                self._recycle(item[0])
                yield batch
        finally:  # stopped early: let the producer finish, and its buffers return to the ring
            stop.set()
            while producer.is_alive() or not pending.empty():
                try:
                    item = pending.get(timeout=0.1)
                except queue.Empty:
                    continue
                if isinstance(item, tuple):
                    self._recycle(item[0])


def split_pack(batch: dict, pieces: int, multiple: int = 1) -> list[tuple[dict, float]]:
    """A packed batch as up to `pieces` shorter ones, cut at conversation boundaries, each padded as packs
    are to a length that is a multiple of `multiple` (flex attention's block size), each with its share
    of the loss-masked tokens (the weight of its loss): how a step that ran out of memory is done again
    in parts. A pack of one conversation cannot be cut (one part)."""
    n, doc = batch["tokens"], batch["document_ids"][0, :batch["tokens"]]
    starts = [0] + (torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1).tolist() + [n]
    cuts = sorted({min(starts, key=lambda b: abs(b - k * n / pieces)) for k in range(1, pieces)} - {0, n})
    total = float(batch["loss_mask"][0, :n].sum())
    parts = []
    for a, b in zip([0] + cuts, cuts + [n]):
        pad = -(b - a) % multiple
        part = {k: torch.nn.functional.pad(v[:, a:b].movedim(1, -1), (0, pad), value=-1 if k == "document_ids" else 0
                                           ).movedim(-1, 1) if torch.is_tensor(v) else v for k, v in batch.items()}
        part["tokens"] = b - a
        parts.append((part, float(part["loss_mask"].sum()) / total if total else (b - a) / n))
    return parts


def collect_rows(data_dirs, vocab_dir: str, verifier_hash: str, hidden_size: int):
    """Files and lengths of every extracted row, after checking the upstream manifests agree."""
    folders = find_stage_dirs(data_dirs, "hidden_states")
    manifests = [read_manifest(f, "hidden_states") for f in folders]
    aux = manifests[0]["aux_layers"]
    for folder, m in zip(folders, manifests):
        if m["aux_layers"] != aux:
            raise UserError(f"{folder} holds aux layers {m['aux_layers']} but {folders[0]} holds {aux}; train on one set")
        if m["hidden_size"] != hidden_size or m["inputs"]["verifier_hash"] != verifier_hash:
            raise UserError(f"{folder} holds states of another verifier (hidden size {m['hidden_size']}, "
                            f"{m['num_hidden_layers']} layers) than --verifier-path; rerun 03_extract_hidden_states.py")
    prepared = [extracted_from(folder, m) for folder, m in zip(folders, manifests)]
    check_vocab_mapping(vocab_dir, {p: (m["inputs"]["prepared_manifest_hash"], m["inputs"]["tokenizer_hash"])
                                    for p, m in zip(prepared, manifests)}, "the hidden states")
    files, lengths = [], []
    for folder, prepared in zip(folders, prepared):
        for i, n in enumerate(load_prepared(prepared)["seq_len"]):
            check_row_file(row_file(folder, i), n, len(aux) + 1, hidden_size)
            files.append(row_file(folder, i))
            lengths.append(n - 1)  # after the one-token shift
    return files, lengths, aux, folders


def check_vocab_mapping(vocab_dir: str, prepared: dict, what: str) -> None:
    """The vocab mapping was built for the tokenizer and the rows a run trains on ({prepared folder: (its rows'
    hash, its tokenizer's hash)}), or one line saying to rerun 02."""
    vm = read_manifest(vocab_dir, "vocab_mapping")
    if {tok for _, tok in prepared.values()} != {vm["inputs"]["tokenizer_hash"]}:
        raise UserError(f"{vocab_dir} was built for another tokenizer than {what}; rerun 02_build_vocab_mapping.py")
    built_from = {os.path.basename(os.path.normpath(f)): h for f, h in vm["inputs"].get("prepared", {}).items()}
    for folder, (rows_hash, _) in prepared.items():
        if built_from.get(os.path.basename(os.path.normpath(folder)), rows_hash) != rows_hash:
            raise UserError(f"{vocab_dir} was built from other rows than {folder} holds now (01 was rerun since): "
                            "its draft vocabulary is not theirs; rerun 02_build_vocab_mapping.py")


def rows_fingerprint(folders: list[str], prepared_hashes: list[str] | None = None) -> str:
    """Which rows a run trains on: each folder's name and the hash of its prepared rows (for 03's folders, the rows
    their states were extracted from), the same for a run from disk and one whose states are computed as it trains,
    so either resumes the other."""
    if prepared_hashes is None:
        prepared_hashes = [read_manifest(f, "hidden_states")["inputs"]["prepared_manifest_hash"] for f in folders]
    return sha256_json([[os.path.basename(os.path.normpath(f)), h] for f, h in zip(folders, prepared_hashes)])


def split_rows(n: int, val_ratio: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = math.ceil(n * val_ratio) if val_ratio > 0 else 0
    if n - n_val < 1:
        raise UserError(f"--val-ratio {val_ratio} leaves no training rows out of {n}; lower it")
    return sorted(order[n_val:]), sorted(order[:n_val])


def epoch_batches(lengths, max_len, seed, epoch, rank, world, accum: int = 1) -> list:
    """Packed batches of row indices for one epoch: deterministic in (seed, epoch), split across ranks. With `accum`
    packs per optimizer step, a rank takes the packs of `accum` ranks of a world that many times larger, one of each
    per step: so N processes train on the packs one process takes with --grad-accum N (the same global batch)."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    shares = []
    for part in range(rank * accum, (rank + 1) * accum):
        sampler = MultipackDistributedBatchSamplerV2(max_len, lengths, world * accum, part, seed=seed)
        sampler.set_epoch(epoch)
        shares.append([list(b) for b in sampler])
    return [b for step in zip(*shares) for b in step]
