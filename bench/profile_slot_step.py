#!/usr/bin/env python3
"""Where the slots decoder's step goes (01 --regen-batching slots): one decode step of common/slot_decode.py
at N slots, replayed from its CUDA graph and profiled eagerly, on random weights of SmolLM2-135M's shapes
(speed does not depend on their values; no verifier files needed). Prints the replay time per span, tokens/s
if every slot were busy, the eager step's heaviest CUDA kernels, one layer's attention written seven ways, and
with --generate a whole generate() run's rate and its host and GPU profiles.
--attention names the step's attention: flash (FlashAttention's varlen kernel, each slot read to its own
position, the decoder's choice on a GPU) and sdpa (SDPA over the span that holds the longest position).
Usage: python bench/profile_slot_step.py --slots 512 1024 --position 1500 --generate 2048 --profile
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import slot_decode
from common.slot_decode import SlotDecoder

FLASH_WORKS = slot_decode.flash_works


def decoder(model, slots, max_len, attention) -> SlotDecoder:
    """A SlotDecoder whose step uses `attention` (flash, if it works here, or sdpa)."""
    slot_decode.flash_works = FLASH_WORKS if attention == "flash" else lambda *a: False
    dec = SlotDecoder(model, slots, max_len, prefill_tokens=32768)
    if dec.flash != (attention == "flash"):
        raise SystemExit(f"--attention {attention}: not usable on this machine")
    return dec


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, nargs="+", default=[256, 512, 1024], help="rows of the KV cache")
    p.add_argument("--max-len", type=int, default=2048, help="the length of each cache row")
    p.add_argument("--position", type=int, default=1500, help="where every slot stands (sets the span)")
    p.add_argument("--attention", nargs="+", default=["flash", "sdpa"], choices=["flash", "sdpa"],
                   help="the step's attention, each timed in turn")
    p.add_argument("--random-positions", action="store_true",
                   help="slots stand at random positions up to --position (the spread of a real run), not all at it")
    p.add_argument("--profile", action="store_true", help="print the eager step's kernels and generate()'s profiles")
    p.add_argument("--generate", type=int, default=0,
                   help="also time generate() over this many random prompts (64-1024 tokens, 32-512 new) at the "
                        "first --slots, with the host's share of the time")
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    for slots, attention in [(s, a) for s in args.slots for a in args.attention]:
        dec = decoder(model, slots, args.max_len, attention)
        tokens = torch.randint(0, 49152, (slots,), device="cuda")
        pos = (torch.randint(0, args.position + 1, (slots,), device="cuda") if args.random_positions
               else torch.full((slots,), args.position, device="cuda"))
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
            print(f"{attention}: slots {slots} span {span}: graph replay {ms:.2f} ms a step, {slots / ms * 1000:,.0f} tok/s if all busy",
                  flush=True)
        if args.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                dec.step(tokens, pos, dec.spans[-1])
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        if args.profile and attention == args.attention[0]:
            attention_variants(slots, dec.kv_heads, dec.heads // dec.kv_heads, dec.head_dim, args.max_len, args.position)
        del dec
        torch.cuda.empty_cache()
    for slots, attention in [(s, a) for s in args.slots[:1] for a in args.attention] if args.generate else []:
        time_generate(model, slots, args.max_len, args.generate, args.profile, attention)


def timed(fn, repeat=20) -> float:
    """ms per call of fn on the GPU."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def attention_variants(n, kv_heads, groups, hd, max_len, position):
    """One layer's decode attention over the slots, written seven ways (the step runs it 30 times): flex
    attention, which reads each slot's blocks up to its own position only, was the slowest kernel that reads little."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(n, kv_heads, groups, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, kv_heads, max_len, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pos = torch.randint(0, position + 1, (n,), device="cuda")
    mask = (torch.arange(max_len, device="cuda")[None, :] <= pos[:, None])[:, None, None, :]
    add = torch.zeros(mask.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))

    def manual():
        s = torch.einsum("nkgd,nksd->nkgs", q, k).float().masked_fill(~mask, float("-inf"))
        return torch.einsum("nkgs,nksd->nkgd", s.softmax(-1).to(v.dtype), v)
    variants = {"sdpa bool mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                "sdpa additive mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=add),
                "manual einsum": manual}
    for name, backend in [("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa math", SDPBackend.MATH),
                          ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)]:
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        variants[name] = run
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    block = 128
    indices = torch.arange(max_len // block, dtype=torch.int32, device="cuda").expand(n, 1, 1, -1).contiguous()
    blocks = (pos // block + 1).view(n, 1, 1).to(torch.int32)
    block_mask = BlockMask.from_kv_blocks(blocks, indices, BLOCK_SIZE=block, mask_mod=lambda b, h, qi, kv: kv <= pos[b],
                                          seq_lengths=(1, max_len), compute_q_blocks=False)
    flex = torch.compile(flex_attention, dynamic=False)
    variants["flex, own blocks"] = lambda: flex(q.reshape(n, kv_heads * groups, 1, hd), k, v, block_mask=block_mask,
                                                enable_gqa=True)
    gb = 2 * k.numel() * k.element_size() / 1e9
    for name, fn in variants.items():
        try:
            ms = timed(fn)
            print(f"attention {name:>20} at {n} slots x {max_len}: {ms:.3f} ms a layer ({gb / ms:.2f} TB/s of K+V)",
                  flush=True)
        except RuntimeError as e:
            print(f"attention {name:>20}: fails ({str(e).splitlines()[0][:120]})", flush=True)


def time_generate(model, slots, max_len, count, profile, attention):
    import random
    import time
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 49152) for _ in range(rng.randrange(64, 1024))] for _ in range(count)]
    max_new = [rng.randrange(32, 512) for _ in range(count)]
    dec = decoder(model, slots, max_len, attention)
    pick = lambda logits: logits.argmax(-1)  # noqa: E731
    dec.generate(prompts[:8], max_new[:8], pick, eos=0)
    torch.cuda.synchronize()
    t0 = time.time()
    out = dec.generate(prompts, max_new, pick, eos=0)
    torch.cuda.synchronize()
    seconds = time.time() - t0
    tokens = sum(len(r) for r, _ in out)
    print(f"{attention}: generate: {count} prompts, {tokens:,} tokens in {seconds:.1f}s = {tokens / seconds:,.0f} tok/s at {slots} "
          f"slots", flush=True)
    if not profile:
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        dec.generate(prompts[:count // 4], max_new[:count // 4], pick, eos=0)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=50))


if __name__ == "__main__":
    main()
