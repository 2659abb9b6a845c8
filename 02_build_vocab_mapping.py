#!/usr/bin/env python3
"""Stage 02: assistant-token frequencies -> draft vocabulary (token_freq.pt, d2t.npy, t2d.npy) in <data-dir>/vocab_mapping."""
import os
import time

import numpy as np
import torch

from common.errors import UserError
from common.cli import add_verifier_flags, run_stage, stage_parser
from common.config import number, resolved
from common.data import load_prepared
from common.layout import DataDir
from common.log import log
from common.manifest import (atomic_dir, find_stage_dirs, output_lock, prepared_fingerprint, read_manifest,
                             write_manifest)
from common.verifier import load_text_config, load_tokenizer, remote_code_needed, resolve_verifier, tokenizer_fingerprint
from common.vocab import build_mapping, count_assistant_tokens

STAGE = "02_build_vocab_mapping"


def build_parser():
    p = stage_parser(STAGE, __doc__)
    add_verifier_flags(p)
    p.add_argument("--data-dir", default="data", help="data root holding prepared/rows_* (all are counted)")
    p.add_argument("--prepared-dirs", nargs="+", help="count only these prepared rows_A-B folders")
    p.add_argument("--draft-vocab-size", type=number(int, 1), default=32000, help="tokens in the draft's vocabulary")
    p.add_argument("--output-dir", help="where to write the mapping (default <data-dir>/vocab_mapping)")
    return p


def run(args):
    out = args.output_dir or DataDir(args.data_dir).vocab_mapping
    with output_lock(os.path.dirname(os.path.abspath(out)), f".lock.{os.path.basename(out)}"):  # one run writes it
        return build(args, out)


def build(args, out: str) -> str:
    start = time.time()
    verifier = resolve_verifier(args.verifier_path)
    args = resolved(args, trust_remote_code=remote_code_needed(verifier, args.trust_remote_code))
    tokenizer = load_tokenizer(verifier, args.trust_remote_code)
    target_vocab = load_text_config(verifier, args.trust_remote_code).vocab_size  # embedding rows, may exceed len(tokenizer)
    folders = find_stage_dirs(args.prepared_dirs or args.data_dir, "prepare")
    tok_hash = tokenizer_fingerprint(tokenizer)
    for folder in folders:
        if read_manifest(folder, "prepare")["inputs"]["tokenizer_hash"] != tok_hash:
            raise UserError(f"{folder} was tokenized with another tokenizer than {verifier}'s; "
                            "rerun 01_prepare_dataset.py with this --verifier-path")
    freq = count_assistant_tokens([load_prepared(f) for f in folders], target_vocab)
    if args.draft_vocab_size >= target_vocab:
        log.warning(f"--draft-vocab-size {args.draft_vocab_size} >= the verifier's vocabulary {target_vocab}: "
                    f"the draft keeps the whole vocabulary ({target_vocab} tokens, d2t all zeros)")
    d2t, t2d, stats = build_mapping(freq, args.draft_vocab_size)
    if stats["filled_unseen"]:
        log.info(f"only {stats['distinct_assistant_tokens']:,} distinct assistant tokens < draft size "
                 f"{stats['draft_vocab']:,}: filled {stats['filled_unseen']:,} slots with unseen tokens, lowest ids first")
    with atomic_dir(out) as tmp:
        torch.save(freq, os.path.join(tmp, "token_freq.pt"))
        np.save(os.path.join(tmp, "d2t.npy"), d2t)
        np.save(os.path.join(tmp, "t2d.npy"), t2d)
        write_manifest(tmp, "vocab_mapping", args, wall_s=time.time() - start, counts=stats,
                       inputs={"verifier_path": verifier, "tokenizer_hash": tok_hash,
                               "prepared": {f: prepared_fingerprint(f) for f in folders}})
    return (f"wrote {out}: draft vocab {stats['draft_vocab']:,} of {target_vocab:,}, "
            f"{stats['distinct_assistant_tokens']:,} distinct assistant tokens, coverage {stats['coverage']:.2%}")


if __name__ == "__main__":
    run_stage(STAGE, build_parser(), run)
