#!/usr/bin/env python3
"""Stage 01: conversations -> tokenized rows (input_ids, loss_mask, seq_len) in <data-dir>/prepared/rows_A-B."""
import random
import time
from collections import Counter

from common.errors import UserError
from common.cli import add_verifier_flags, check_cuda, parse_rows, run_stage, stage_parser
from common.config import RegenConfig, add_options, from_args, number, resolved
from common.data import SELF_WRITTEN, WRITE_PROMPT, is_held_out, load_records, normalize, prepare_rows, rows_hash
from common.layout import DataDir, shard
from common.log import Progress, log
from common.manifest import atomic_dir, output_lock, write_manifest
from common.verifier import (load_text_config, load_tokenizer, remote_code_needed, resolve_verifier, tokenizer_fingerprint,
                             verifier_fingerprint)

STAGE = "01_prepare_dataset"


def build_parser():
    p = stage_parser(STAGE, __doc__)
    add_verifier_flags(p)
    p.add_argument("--dataset", default="sharegpt",
                   help="'sharegpt' (built in); 'self-written': prompts the verifier writes itself from its chat "
                        "template's user header (Magpie), sampled, then answered (needs --regenerate, and "
                        "--num-samples or --rows for how many); a local .json/.jsonl/.parquet file; or a "
                        "datasets.load_dataset name")
    p.add_argument("--split", default="train", help="split to read from a Hugging Face dataset")
    p.add_argument("--data-dir", default="data", help="data root; rows go to <data-dir>/prepared/rows_A-B")
    p.add_argument("--max-seq-len", type=number(int, 1), default=2048, help="truncate each row to this many tokens")
    p.add_argument("--rows", help="A-B: take conversations A..B-1 of the shuffled list (to shard big jobs)")
    p.add_argument("--num-samples", type=number(int, 1), help="take the first N conversations (same as --rows 0-N)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle of the conversation list")
    p.add_argument("--no-shuffle", action="store_true", help="keep the source order")
    p.add_argument("--reasoning", choices=["train", "drop"], default="train",
                   help="replies' reasoning (a reasoning_content field, or an inline <think> block): train on it "
                        "where the chat template renders it, as the verifier generates it when it serves with "
                        "reasoning on (Kimi-K2.5's and Qwen3's default), or drop it from every reply (a verifier "
                        "served without reasoning); the log counts the conversations changed either way")
    g = p.add_argument_group("regeneration: every assistant reply rewritten by the verifier, turn by turn")
    add_options(g, RegenConfig)  # each flag's default, help and check: common/config.py
    return p


def run(args):
    if args.rows and args.num_samples:
        raise UserError("give --rows or --num-samples, not both")
    rows_range = parse_rows(args.rows)
    start = time.time()
    verifier = resolve_verifier(args.verifier_path)
    # the settings resolved in one visible step (the manifest records them)
    args = resolved(args, trust_remote_code=remote_code_needed(verifier, args.trust_remote_code))
    if args.regenerate != "none":
        import torch
        if args.device == "auto":
            args = resolved(args, device="cuda" if torch.cuda.is_available() else "cpu")
        check_cuda(args.device)
    tokenizer = load_tokenizer(verifier, args.trust_remote_code)
    if tokenizer.chat_template is None:
        raise UserError(f"the tokenizer of {verifier} has no chat template; use a chat (instruct) model's folder")
    notes = {}  # what the reader noticed (a cut-off tail), reported in the manifest
    if args.dataset == SELF_WRITTEN:  # as many conversations as asked for, each to be written by the verifier
        if args.regenerate == "none":
            raise UserError("--dataset self-written: the verifier writes these conversations; pass --regenerate "
                            "transformers or vllm")
        if not (rows_range or args.num_samples):
            raise UserError("--dataset self-written: say how many conversations with --num-samples N or --rows A-B")
        records = [WRITE_PROMPT] * (rows_range or (0, args.num_samples))[1]
    else:
        records = load_records(args.dataset, args.split, notes)
    if not records:
        raise UserError(f"--dataset {args.dataset}: holds no conversations")
    indexed = list(enumerate(records))
    if not args.no_shuffle:
        random.Random(args.seed).shuffle(indexed)
    a, b = rows_range or (0, args.num_samples or len(indexed))
    if b > len(indexed):
        asked = f"--rows {a}-{b}" if rows_range else f"--num-samples {b}"
        raise UserError(f"{asked}: the dataset has only {len(indexed)} conversations")
    selected = indexed[a:b]
    log.info(f"{len(records)} conversations in {args.dataset}; preparing rows {a}-{b}")
    with output_lock(DataDir(args.data_dir).prepared(), f".lock.{shard(a, b)}"):  # one run writes a shard
        return prepare_shard(args, selected, a, b, tokenizer, verifier, start, notes)


def prepare_shard(args, selected, a, b, tokenizer, verifier, start, notes):

    # the fixed held-out split (common/data.py) never becomes a training row
    selected = [(i, "held_out" if is_held_out(args.dataset, i) else r) for i, r in selected]
    regen_counts = None
    if args.regenerate != "none":
        from common.regenerate import regenerate
        selected = [(i, r if isinstance(r, str) or r == WRITE_PROMPT else normalize(r)) for i, r in selected]
        selected, regen_counts = regenerate(selected, tokenizer, verifier,
                                            verifier_fingerprint(load_text_config(verifier, args.trust_remote_code)),
                                            DataDir(args.data_dir).regenerated(shard(a, b)),
                                            from_args(RegenConfig, args))
    progress = Progress(len(selected), "rows")
    changed = Counter()
    rows, dropped = prepare_rows(tokenizer, selected, args.max_seq_len, on_row=progress.update, reasoning=args.reasoning,
                                 changed=changed)
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
              "assistant_tokens": assistant, "dropped": dict(dropped), "changed": dict(changed),
              "max_row_tokens": max(r["seq_len"] for r in rows), "rows_hash": rows_hash(rows),
              **({"regeneration": regen_counts} if regen_counts is not None else {}), **notes}
    out = DataDir(args.data_dir).prepared(shard(a, b))
    with atomic_dir(out) as tmp:
        ds = datasets.Dataset.from_list(rows)
        ds.set_format("torch")  # as speculators' prepare-data saves it, so `speculators train` reads it too
        ds.save_to_disk(tmp)
        write_manifest(tmp, "prepare", args, wall_s=time.time() - start, counts=counts,
                       inputs={"dataset": args.dataset, "verifier_path": verifier,
                               "tokenizer_hash": tokenizer_fingerprint(tokenizer),
                               "vocab_size": len(tokenizer)}, rows=[a, b])
    log.info(f"dropped by reason: {dict(dropped) or 'none'}; changed by reason: {dict(changed) or 'none'}")
    return (f"wrote {out}: {len(rows):,} rows of {args.dataset}, {total:,} total tokens, {assistant:,} assistant tokens, "
            f"{sum(dropped.values())} dropped" + (f"; {args.dataset} is cut off: its last "
                                                  f"{notes['truncated_tail_bytes']:,} bytes were not read"
                                                  if "truncated_tail_bytes" in notes else ""))


if __name__ == "__main__":
    run_stage(STAGE, build_parser(), run)
