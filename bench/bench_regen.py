#!/usr/bin/env python3
"""Regeneration throughput of 01's transformers batchings on the same prompts, side by side in one run.

The real verifier (the embedded default unless --verifier), the first user turns of ShareGPT conversations
(in 01's order), greedy, the same --max-new-tokens for each; prints generated tokens/s of each batching,
its ratio to `padded`, and how many replies equal padded's once greedy loops are cut as 01 cuts them (slots
stops a looping reply early; bf16 on a GPU may flip a near-tie).
Usage: python bench/bench_regen.py --prompts 512 --max-new-tokens 256 --batchings padded slots

--conversations N instead runs 01's regeneration (every reply of N whole conversations, a next turn as soon as
its reply ends) through the slots decoder twice: conversations started shortest prompt first with a next turn
at the back of the queue (the order before 2026-12-06), and with the most turns to come first and a next turn
at the front (01's order now); prints decode steps, the slots' occupancy and tokens/s of each.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import slot_decode
from common.data import load_records, normalize
from common.regenerate import TransformersGenerator, cut_loop, encode, script
from common.verifier import ensure_default_verifier


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifier", default=None, help="verifier path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=512, help="first user turns to answer")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest reply")
    p.add_argument("--max-seq-len", type=int, default=2048, help="slots: the length of each cache row")
    p.add_argument("--batch-tokens", type=int, default=1 << 20, help="01's --regen-batch-tokens")
    p.add_argument("--batchings", nargs="+", default=["padded", "slots"],
                   help="of padded, continuous, slots, slots-sdpa (slots with SDPA over a span where it would use "
                        "FlashAttention's per-slot lengths)")
    p.add_argument("--baseline-prompts", type=int, default=0,
                   help="the first batching answers only this many of the prompts (0: all): padded generate() is slow")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--fp32", action="store_true", help="float32 on the GPU too: replies then agree but for true ties")
    p.add_argument("--conversations", type=int, default=0,
                   help="compare the slots decoder's orders on 01's regeneration of this many whole conversations")
    args = p.parse_args()
    from transformers import AutoTokenizer
    verifier = args.verifier or ensure_default_verifier()
    tok = AutoTokenizer.from_pretrained(verifier)
    if args.conversations:
        return compare_orders(args, verifier, tok)
    prompts = []
    for record in load_records("sharegpt"):
        messages = normalize(record)
        groups = [] if isinstance(messages, str) else script(messages)
        if groups:
            ids = encode(tok, groups[0])
            if len(ids) + args.max_new_tokens <= args.max_seq_len:
                prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    print(f"{len(prompts)} prompts, {sum(map(len, prompts)):,} prompt tokens, up to {args.max_new_tokens} new tokens, "
          f"{args.device}, {'float32' if args.fp32 or args.device == 'cpu' else 'bfloat16'}")
    first, flash_works = None, slot_decode.flash_works
    for batching in args.batchings:
        slot_decode.flash_works = flash_works if batching == "slots" else lambda *a: False
        gen = TransformersGenerator(verifier, args.device, False, args.batch_tokens, tok.eos_token_id,
                                    tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                                    batching.split("-")[0], args.max_seq_len, torch.float32 if args.fp32 else None)
        gen(prompts[:4], [8] * 4, 0.0, 1.0, [0] * 4)  # warm-up
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        some = prompts[:args.baseline_prompts or None] if first is None else prompts
        t0 = time.time()
        out = gen(some, [args.max_new_tokens] * len(some), 0.0, 1.0, [0] * len(some))
        seconds = time.time() - t0
        rate = sum(len(r) + f for r, f in out) / seconds
        first = first or (batching, rate, out)
        same = sum(trained(a) == trained(b) for a, b in zip(out, first[2]))
        print(f"{batching:>10}: {rate:9,.0f} generated tok/s on {len(some)} prompts  {rate / first[1]:5.2f}x {first[0]}  "
              f"{same}/{len(first[2])} replies equal {first[0]}'s  ({seconds:.1f}s)", flush=True)
        del gen
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


class ShortestFirst:
    """The slots generator without 01's order: shortest prompt first, a next turn at the back of the queue."""
    streams = True

    def __init__(self, gen):
        self.gen = gen

    def stream(self, prompts, max_new, temperature, top_p, seed, follow=None, first=None):
        out = self.gen.stream(prompts, max_new, temperature, top_p, seed, follow)
        self.occupancy = self.gen.occupancy
        return out


def compare_orders(args, verifier, tok):
    from collections import Counter

    from common.config import RegenConfig
    from common.regenerate import regenerate_part
    part = [(i, normalize(r)) for i, r in enumerate(load_records("sharegpt")[:args.conversations])]
    cfg = RegenConfig(regenerate="transformers", max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len,
                      regen_batch_tokens=args.batch_tokens, regen_batching="slots")
    gen = TransformersGenerator(verifier, args.device, False, args.batch_tokens, tok.eos_token_id,
                                tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, "slots",
                                args.max_seq_len, torch.float32 if args.fp32 else None)
    gen([tok.encode("Hello")] * 4, [8] * 4, 0.0, 1.0, [0] * 4)  # warm-up
    print(f"{args.conversations} conversations, up to {args.max_new_tokens} new tokens a reply, "
          f"{min(args.batch_tokens // args.max_seq_len, args.conversations)} "
          f"slots, {args.device}")
    first = None
    for name, generate in [("shortest first", ShortestFirst(gen)), ("most turns first", gen)]:
        counts = Counter()
        t0 = time.time()
        rows = regenerate_part(generate, tok, part, cfg, counts)
        seconds = time.time() - t0
        steps, occupancy = generate.occupancy
        first = first or (name, steps, rows)
        same = sum(a == b for a, b in zip(rows, first[2]))
        print(f"{name:>17}: {counts['replies']:,} replies, {counts['generated_tokens']:,} tokens, {steps:,} decode steps "
              f"({steps / first[1]:.2f}x {first[0]}), slots {occupancy:.0%} busy, "
              f"{counts['generated_tokens'] / seconds:,.0f} generated tok/s ({seconds:.1f}s); "
              f"{same}/{len(rows)} conversations equal {first[0]}'s", flush=True)


def trained(result):
    """A (reply, finished) as 01 keeps it: a reply cut by its limit loses its loop's repeats."""
    reply, finished = result
    return reply if finished else (cut_loop(reply) or reply)


if __name__ == "__main__":
    main()
