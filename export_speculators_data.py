#!/usr/bin/env python3
"""Lay a data dir out as `python -m speculators.train --data-path` reads it, without copying the states.

speculators wants one dataset folder (input_ids, loss_mask, seq_len) with hidden_states/hs_<i>.safetensors,
d2t-<N>.npy, t2d-<N>.npy and token_freq.pt beside it; ours keeps per-shard prepared/rows_A-B and
hidden_states/rows_A-B folders and vocab_mapping/. This writes the merged rows (small) and links the rest:

    python export_speculators_data.py --data-dir data --output-dir data/speculators
    python -m speculators.train --data-path data/speculators --draft-vocab-size N ...
"""
import os

import numpy as np

from common.cli import run_stage, stage_parser
from common.data import load_prepared
from common.layout import DataDir
from common.rows import check_row_file, row_file
from common.manifest import atomic_dir, extracted_from, find_stage_dirs, output_lock, read_manifest

STAGE = "export_speculators_data"


def build_parser():
    p = stage_parser(STAGE, __doc__)
    p.add_argument("--data-dir", default="data", help="data root holding prepared/, vocab_mapping/ and hidden_states/")
    p.add_argument("--output-dir", help="the speculators data folder to write (default: <data-dir>/speculators)")
    return p


def run(args):
    out = os.path.abspath(args.output_dir or os.path.join(args.data_dir, "speculators"))
    with output_lock(os.path.dirname(out), f".lock.{os.path.basename(out)}"):  # one run writes it
        return export(args, out)


def export(args, out: str) -> str:
    import datasets
    vocab = DataDir(args.data_dir).vocab_mapping
    read_manifest(vocab, "vocab_mapping")
    folders = find_stage_dirs(args.data_dir, "hidden_states")
    shards, links = [], []
    for folder in folders:
        manifest = read_manifest(folder, "hidden_states")
        rows = load_prepared(extracted_from(folder, manifest)).select_columns(["input_ids", "loss_mask", "seq_len"])
        for i, n_tokens in enumerate(rows["seq_len"]):  # whole files only: speculators would meet a torn one hours in
            check_row_file(row_file(folder, i), n_tokens, len(manifest["aux_layers"]) + 1, manifest["hidden_size"])
        links += [os.path.abspath(row_file(folder, i)) for i in range(len(rows))]
        shards.append(rows)
    n = len(np.load(os.path.join(vocab, "d2t.npy")))
    with atomic_dir(out) as tmp:
        merged = datasets.concatenate_datasets(shards)
        merged.set_format("torch")
        merged.save_to_disk(tmp)
        os.makedirs(os.path.join(tmp, "hidden_states"))
        # relative links: the data dir can be moved or copied whole with its export
        for i, target in enumerate(links):
            os.symlink(os.path.relpath(target, os.path.join(out, "hidden_states")),
                       row_file(os.path.join(tmp, "hidden_states"), i))
        for name, link in [("d2t.npy", f"d2t-{n}.npy"), ("t2d.npy", f"t2d-{n}.npy"), ("token_freq.pt", "token_freq.pt")]:
            os.symlink(os.path.relpath(os.path.abspath(os.path.join(vocab, name)), out), os.path.join(tmp, link))
    return (f"wrote {out}: {len(links):,} rows from {len(folders)} folder(s), draft vocab {n}; train with "
            f"python -m speculators.train --data-path {out} --draft-vocab-size {n} ...")


if __name__ == "__main__":
    run_stage(STAGE, build_parser(), run)
