"""Where stage 04's hidden states come from (--states-from): 03's row files on disk; the verifier inside the
training process computing each pack's states as it trains (colocated); or a running vLLM server (server). The
last two need no states on disk. The trainer sees one interface: the rows' lengths, the aux layers, a fingerprint
of the rows, and the packed batches."""
import os

import numpy as np
import torch

from common.data import load_prepared
from common.errors import UserError
from common.loader import PackedBatches, check_vocab_mapping, collect_rows, pack_layout, rows_fingerprint
from common.manifest import find_stage_dirs, prepared_fingerprint, read_manifest, sha256_json
from common.verifier import check_aux_layers, default_aux_layers


class DiskStates:
    """The states 03 wrote (`<data>/hidden_states/rows_A-B`)."""
    name = "disk"

    def __init__(self, data_dirs: list[str], vocab_dir: str, verifier_hash: str, hidden: int):
        self.files, self.lengths, self.aux, self.folders = collect_rows(data_dirs, vocab_dir, verifier_hash, hidden)
        self.hidden, self.fingerprint = hidden, rows_fingerprint(self.folders)

    def packed(self, pack_tokens: int, device, dtype, workers: int) -> PackedBatches:
        return PackedBatches(self.files, self.lengths, len(self.aux), self.hidden, pack_tokens, device, dtype, workers)


class PreparedRows:
    """01's rows (`<data>/prepared/rows_A-B`), whose states a verifier computes as each pack is read."""

    def __init__(self, data_dirs: list[str], vocab_dir: str, text_config, layers: list[int] | None):
        self.folders = find_stage_dirs(data_dirs, "prepare")
        manifests = {f: read_manifest(f, "prepare") for f in self.folders}
        hashes = {f: prepared_fingerprint(f) for f in self.folders}
        check_vocab_mapping(vocab_dir, {f: (hashes[f], m["inputs"]["tokenizer_hash"]) for f, m in manifests.items()},
                            "the prepared rows")
        self.ids, self.masks = [], []
        for f in self.folders:
            rows = load_prepared(f)
            self.ids += rows["input_ids"]
            self.masks += rows["loss_mask"]
        self.lengths = [len(r) - 1 for r in self.ids]  # after the one-token shift
        n = text_config.num_hidden_layers
        self.aux = check_aux_layers(layers, n) if layers else default_aux_layers(n)  # 03's default layers
        self.text_config = text_config
        # as DiskStates' fingerprint of states extracted from these rows: a run may resume from another source
        self.fingerprint = sha256_json([[os.path.basename(os.path.normpath(f)), hashes[f]] for f in self.folders])


class ColocatedStates(PreparedRows):
    """States computed by the verifier on the trainer's device, with the hooks 03 uses, so a pack is what it would be
    from 03's files."""
    name = "colocated"

    def __init__(self, data_dirs, vocab_dir, text_config, layers, verifier: str, trust_remote_code: bool, pad_id: int):
        super().__init__(data_dirs, vocab_dir, text_config, layers)
        self.verifier, self.trust, self.pad_id = verifier, trust_remote_code, pad_id

    def packed(self, pack_tokens: int, device, dtype, workers: int) -> "ComputedBatches":
        from common.extract import TransformersBackend
        compute = "bfloat16" if dtype == torch.bfloat16 else "float32"
        backend = TransformersBackend.load(self.verifier, self.aux, self.text_config.num_hidden_layers, compute,
                                           str(device), self.trust)

        def states(rows: list[list[int]]) -> list[torch.Tensor]:
            padded = backend.states(rows, self.pad_id)  # [rows, longest, layers, hidden], as 03 stores them
            return [padded[b, :len(r)] for b, r in enumerate(rows)]
        return ComputedBatches(self, states, pack_tokens, device, dtype)


class ServerStates(PreparedRows):
    """States computed by a running vLLM server (serve_states.py), requested row by row, `workers` at a time."""
    name = "server"

    def __init__(self, data_dirs, vocab_dir, text_config, layers, url: str, tokenizer):
        super().__init__(data_dirs, vocab_dir, text_config, layers)
        from common.states_server import StatesClient
        self.client = StatesClient(url, tokenizer, [*self.aux, text_config.num_hidden_layers], text_config.hidden_size)

    def packed(self, pack_tokens: int, device, dtype, workers: int) -> "ComputedBatches":
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="states-request")  # the requests in flight

        def states(rows: list[list[int]]) -> list[torch.Tensor]:
            return [s.to(torch.bfloat16) for s in pool.map(self.client.states, rows)]  # as 03 stores them
        return ComputedBatches(self, states, pack_tokens, device, dtype)


class ComputedBatches(PackedBatches):
    """PackedBatches whose states are computed for each pack (by `states`, from the rows' token ids) rather than read
    from files: the same plan, layout and assembly; one pack is computed ahead, on the reading thread."""

    def __init__(self, source: PreparedRows, states, max_len: int, device, dtype):
        if not source.ids:
            raise UserError("no prepared rows to train on")
        self.source, self.states = source, states
        self.lengths, self.n_aux, self.hidden = source.lengths, len(source.aux), source.text_config.hidden_size
        self.max_len, self.device, self.dtype, self.fp8 = max_len, device, dtype, False

    def _fill(self, rows: list[int]):
        plan = self._plan(rows)
        takes = [take for _, take in plan]
        ids = [self.source.ids[r][:take + 1] for r, take in plan]
        masks = [self.source.masks[r][:take + 1] for r, take in plan]
        starts = np.cumsum([0] + [take + 1 for take in takes])
        layout = torch.zeros(3, self.max_len, dtype=torch.int64)
        pack_layout(takes, starts, layout[:, :sum(takes)].numpy())
        buf = {"states": torch.cat(self.states(ids)).to(self.device),
               "ids": torch.tensor([t for r in ids for t in r]), "mask": torch.tensor([m for r in masks for m in r]),
               "layout": layout, "release": None}
        return buf, int(starts[-1]), sum(takes)

    def _recycle(self, buf) -> None:
        pass  # nothing pooled: each pack's states are made for it
