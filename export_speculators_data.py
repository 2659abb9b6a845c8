#!/usr/bin/env python3
"""Lay a data dir out as `python -m speculators.train --data-path` reads it, without copying the states.

speculators wants one dataset folder (input_ids, loss_mask, seq_len) with hidden_states/hs_<i>.safetensors,
d2t-<N>.npy, t2d-<N>.npy and token_freq.pt beside it; ours keeps per-shard prepared/rows_A-B and
hidden_states/rows_A-B folders and vocab_mapping/. This writes the merged rows (small) and links the rest:

    python export_speculators_data.py --data-dir data --output-dir data/speculators
    python -m speculators.train --data-path data/speculators --draft-vocab-size N ...

Several data dirs (original and regenerated rows, say) export as one, as 04 trains on them with one vocab mapping.
"""
import os

import numpy as np

from common.cli import run_stage, stage_parser
from common.data import load_prepared
from common.layout import default_vocab_dir
from common.loader import collect_rows
from common.rows import row_file
from common.manifest import atomic_dir, extracted_from, find_stage_dirs, output_lock, read_manifest

STAGE = "export_speculators_data"


def build_parser():
    p = stage_parser(STAGE, __doc__)
    p.add_argument("--data-dir", nargs="+", default=["data"],
                   help="one or more data roots (or their hidden_states/rows_A-B folders) with prepared/ beside")
    p.add_argument("--vocab-mapping-dir", help="output of stage 02 (default: the vocab_mapping folder beside the first "
                                               "data dir)")
    p.add_argument("--output-dir", help="the speculators data folder to write (default: <first data dir>/speculators)")
    return p


def run(args):
    out = os.path.abspath(args.output_dir or os.path.join(args.data_dir[0], "speculators"))
    with output_lock(os.path.dirname(out), f".lock.{os.path.basename(out)}"):  # one run writes it
        return export(args, out)


def export(args, out: str) -> str:
    import datasets
    vocab = args.vocab_mapping_dir or default_vocab_dir(args.data_dir)
    first = read_manifest(find_stage_dirs(args.data_dir, "hidden_states")[0], "hidden_states")
    # 04's checks: one verifier, one set of layers, a mapping for these rows, whole files only (speculators would
    # meet a torn one hours in)
    files, _, _, folders = collect_rows(args.data_dir, vocab, first["inputs"]["verifier_hash"], first["hidden_size"])
    links = [os.path.abspath(f) for f in files]
    shards = [load_prepared(extracted_from(f, read_manifest(f, "hidden_states"))).select_columns(
        ["input_ids", "loss_mask", "seq_len"]) for f in folders]
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
