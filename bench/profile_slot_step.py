#!/usr/bin/env python3
"""Where the slots decoder's step goes (01 --regen-batching slots): one decode step of common/slot_decode.py
at N slots, replayed from its CUDA graph and profiled eagerly, on random weights of SmolLM2-135M's shapes
(speed does not depend on their values; no verifier files needed). Prints the replay time per span, tokens/s
if every slot were busy, and the eager step's heaviest CUDA kernels.
Usage: python bench/profile_slot_step.py --slots 512 --position 1500
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.slot_decode import SlotDecoder  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, nargs="+", default=[256, 512, 1024], help="rows of the KV cache")
    p.add_argument("--max-len", type=int, default=2048, help="the length of each cache row")
    p.add_argument("--position", type=int, default=1500, help="where every slot stands (sets the span)")
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    for slots in args.slots:
        dec = SlotDecoder(model, slots, args.max_len, prefill_tokens=32768)
        tokens = torch.randint(0, 49152, (slots,), device="cuda")
        pos = torch.full((slots,), args.position, device="cuda")
        for span in dec.spans:
            if span <= args.position and span != dec.spans[-1]:
                continue
            for _ in range(3):
                dec.decode(tokens, pos.clamp(max=span - 1), span - 1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                dec.decode(tokens, pos.clamp(max=span - 1), span - 1)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 20
            print(f"slots {slots} span {span}: graph replay {ms:.2f} ms a step, {slots / ms * 1000:,.0f} tok/s if all busy",
                  flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            dec.step(tokens, pos, dec.spans[-1])
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        del dec
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
