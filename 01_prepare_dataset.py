#!/usr/bin/env python3
"""Stage 01: conversations -> tokenized rows (input_ids, loss_mask, seq_len) in <data-dir>/prepared/rows_A-B."""
import os
import random
import time

from common.cli import UserError, add_verifier_flags, parse_rows, run_stage, stage_parser
from common.data import load_records, prepare_rows
from common.log import Progress, log
from common.manifest import atomic_dir, write_manifest
from common.verifier import load_tokenizer, resolve_verifier, tokenizer_fingerprint

STAGE = "01_prepare_dataset"


def build_parser():
    p = stage_parser(STAGE, __doc__)
    add_verifier_flags(p)
    p.add_argument("--dataset", default="sharegpt",
                   help="'sharegpt' (built in), a local .json/.jsonl/.parquet file, or a datasets.load_dataset name")
    p.add_argument("--split", default="train", help="split to read from a Hugging Face dataset")
    p.add_argument("--data-dir", default="data", help="data root; rows go to <data-dir>/prepared/rows_A-B")
    p.add_argument("--max-seq-len", type=int, default=2048, help="truncate each row to this many tokens")
    p.add_argument("--rows", help="A-B: take conversations A..B-1 of the shuffled list (to shard big jobs)")
    p.add_argument("--num-samples", type=int, help="take the first N conversations (same as --rows 0-N)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle of the conversation list")
    p.add_argument("--no-shuffle", action="store_true", help="keep the source order")
    return p


def run(args):
    if args.max_seq_len <= 0:
        raise UserError(f"--max-seq-len {args.max_seq_len}: must be a positive number of tokens")
    if args.rows and args.num_samples:
        raise UserError("give --rows or --num-samples, not both")
    if args.num_samples is not None and args.num_samples <= 0:
        raise UserError(f"--num-samples {args.num_samples}: must be positive")
    rows_range = parse_rows(args.rows)
    start = time.time()
    verifier = resolve_verifier(args.verifier_path)
    tokenizer = load_tokenizer(verifier, args.trust_remote_code)
    if tokenizer.chat_template is None:
        raise UserError(f"the tokenizer of {verifier} has no chat template; use a chat (instruct) model's folder")
    records = load_records(args.dataset, args.split)
    if not records:
        raise UserError(f"--dataset {args.dataset}: holds no conversations")
    indexed = list(enumerate(records))
    if not args.no_shuffle:
        random.Random(args.seed).shuffle(indexed)
    a, b = rows_range or (0, args.num_samples or len(indexed))
    if b > len(indexed):
        raise UserError(f"--rows {a}-{b}: the dataset has only {len(indexed)} conversations")
    selected = indexed[a:b]
    log.info(f"{len(records)} conversations in {args.dataset}; preparing rows {a}-{b}")

    progress = Progress(len(selected), "rows")
    rows, dropped = prepare_rows(tokenizer, selected, args.max_seq_len, on_row=progress.update)
    progress.close()
    if not rows:
        raise UserError(f"no usable rows in {args.dataset} rows {a}-{b} (dropped: {dict(dropped)}); "
                        "check the conversation shape (ShareGPT from/value or role/content)")
    if len(rows) + sum(dropped.values()) != len(selected):
        raise AssertionError("every conversation is either a row or counted as dropped")
    import datasets
    total = sum(r["seq_len"] for r in rows)
    assistant = sum(sum(r["loss_mask"]) for r in rows)
    counts = {"conversations": len(selected), "rows": len(rows), "total_tokens": total,
              "assistant_tokens": assistant, "dropped": dict(dropped),
              "max_row_tokens": max(r["seq_len"] for r in rows)}
    out = os.path.join(args.data_dir, "prepared", f"rows_{a}-{b}")
    with atomic_dir(out) as tmp:
        ds = datasets.Dataset.from_list(rows)
        ds.set_format("torch")  # as speculators' prepare-data saves it, so `speculators train` reads it too
        ds.save_to_disk(tmp)
        write_manifest(tmp, "prepare", args, wall_s=time.time() - start, counts=counts,
                       inputs={"dataset": args.dataset, "verifier_path": verifier,
                               "tokenizer_hash": tokenizer_fingerprint(tokenizer),
                               "vocab_size": len(tokenizer)}, rows=[a, b])
    log.info(f"dropped by reason: {dict(dropped) or 'none'}")
    return (f"wrote {out}: {len(rows):,} rows, {total:,} total tokens, {assistant:,} assistant tokens, "
            f"{sum(dropped.values())} dropped")


if __name__ == "__main__":
    run_stage(STAGE, build_parser(), run)
