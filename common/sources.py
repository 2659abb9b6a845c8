"""Where stage 04's hidden states come from (--states-from): 03's row files on disk, or the verifier inside the
training process computing each pack's states as it trains (colocated: no states on disk at all). The trainer
sees one interface: the rows' lengths, the aux layers, a fingerprint of the rows, and the packed batches."""
import os

import numpy as np
import torch

from common.data import load_prepared
from common.errors import UserError
from common.loader import PackedBatches, check_vocab_mapping, collect_rows, pack_layout, rows_fingerprint
from common.manifest import find_stage_dirs, prepared_fingerprint, read_manifest, sha256_json
from common.verifier import default_aux_layers


class DiskStates:
    """The states 03 wrote (`<data>/hidden_states/rows_A-B`)."""
    name = "disk"

    def __init__(self, data_dirs: list[str], vocab_dir: str, verifier_hash: str, hidden: int):
        self.files, self.lengths, self.aux, self.folders = collect_rows(data_dirs, vocab_dir, verifier_hash, hidden)
        self.hidden, self.fingerprint = hidden, rows_fingerprint(self.folders)

    def packed(self, pack_tokens: int, device, dtype, workers: int) -> PackedBatches:
        return PackedBatches(self.files, self.lengths, len(self.aux), self.hidden, pack_tokens, device, dtype, workers)


class ColocatedStates:
    """01's rows (`<data>/prepared/rows_A-B`), their states computed by the verifier on the trainer's device as each
    pack is read, with the layers and the hooks 03 uses, so a pack is what it would be from 03's files."""
    name = "colocated"

    def __init__(self, data_dirs: list[str], vocab_dir: str, verifier: str, text_config, trust_remote_code: bool,
                 pad_id: int):
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
        self.verifier, self.text_config, self.trust, self.pad_id = verifier, text_config, trust_remote_code, pad_id
        self.aux = default_aux_layers(text_config.num_hidden_layers)  # 03's default layers
        self.fingerprint = sha256_json([[os.path.basename(os.path.normpath(f)), hashes[f]] for f in self.folders])

    def packed(self, pack_tokens: int, device, dtype, workers: int) -> "VerifierBatches":
        from common.extract import TransformersBackend
        compute = "bfloat16" if dtype == torch.bfloat16 else "float32"
        backend = TransformersBackend.load(self.verifier, self.aux, self.text_config.num_hidden_layers, compute,
                                           str(device), self.trust)
        return VerifierBatches(self, backend, pack_tokens, device, dtype)


class VerifierBatches(PackedBatches):
    """PackedBatches whose states come from the verifier's forward over the pack's rows rather than from files
    (the same plan, layout and assembly; one pack is computed ahead, on the reading thread)."""

    def __init__(self, source: ColocatedStates, backend, max_len: int, device, dtype):
        if not source.ids:
            raise UserError("no prepared rows to train on")
        self.source, self.backend = source, backend
        self.lengths, self.n_aux, self.hidden = source.lengths, len(source.aux), source.text_config.hidden_size
        self.max_len, self.device, self.dtype, self.fp8 = max_len, device, dtype, False

    def _fill(self, rows: list[int]):
        plan = self._plan(rows)
        takes = [take for _, take in plan]
        ids = [self.source.ids[r][:take + 1] for r, take in plan]
        masks = [self.source.masks[r][:take + 1] for r, take in plan]
        states = self.backend.states(ids, self.source.pad_id)  # [rows, longest, aux + 1, hidden], as 03 stores them
        starts = np.cumsum([0] + [take + 1 for take in takes])
        layout = torch.zeros(3, self.max_len, dtype=torch.int64)
        pack_layout(takes, starts, layout[:, :sum(takes)].numpy())
        buf = {"states": torch.cat([states[b, :take + 1] for b, take in enumerate(takes)]),
               "ids": torch.tensor([t for r in ids for t in r]), "mask": torch.tensor([m for r in masks for m in r]),
               "layout": layout, "release": None}
        return buf, int(starts[-1]), sum(takes)

    def _recycle(self, buf) -> None:
        pass  # nothing pooled: each pack's states are made for it
