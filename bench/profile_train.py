#!/usr/bin/env python3
"""Where a training step of stage 04 spends its GPU time: one packed batch kept on the GPU, the step
(forward, backward, clip, AdamW) timed alone for each variant, the loader timed alone, and the top
kernels of the compiled step from torch.profiler.

  python bench/profile_train.py --shape llama-3.1-8b --seq-len 2048 --work /tmp/bt --out /tmp/prof
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--variants", nargs="+", default=["eager", "compile"], help="eager, compile, compile+flex")
    p.add_argument("--work", default="/tmp/bench_train")
    p.add_argument("--out", default=None, help="write the profiler table and trace here")
    args = p.parse_args()
    from bench_train import make_inputs
    from common.draft import build_draft
    from common.loader import PackedBatches, collect_rows, epoch_batches
    from speculators.losses import resolve_loss_config
    make_inputs(args.work, args.shape, args.rows, args.seq_len, 32000)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    verifier = os.path.join(args.work, "verifier")
    data, vm = os.path.join(args.work, "data"), os.path.join(args.work, "data", "vocab_mapping")
    from transformers import AutoConfig
    hidden = AutoConfig.from_pretrained(verifier).hidden_size
    files, lengths, aux, _ = collect_rows([data], vm, json.load(open(os.path.join(data, "hidden_states", f"rows_0-{args.rows}", "manifest.json")))["inputs"]["verifier_hash"], hidden)
    batches = epoch_batches(lengths, args.seq_len, 0, 0, 0, 1)
    results = {}

    def sync():
        if on_gpu:
            torch.cuda.synchronize()
    t0 = time.time()
    n = 0
    packed = PackedBatches(files, lengths, len(aux), hidden, args.seq_len, device,
                           torch.bfloat16 if on_gpu else torch.float32, threads=4)
    for batch in packed(batches * 3):
        sync()
        n += 1
        if n == 4:
            t0 = time.time()
    results["loader_ms_per_batch"] = 1000 * (time.time() - t0) / (n - 4)
    print("loader alone:", f"{results['loader_ms_per_batch']:.1f} ms/batch", flush=True)
    tokens = batch.pop("tokens")
    gpu = batch

    for variant in args.variants:
        attn = "simple_flex_attention" if "flex" in variant else "sdpa"
        model = build_draft(verifier, aux, vm, 3, attn, device=device)
        for frozen in (model.embed_tokens, model.lm_head, model.verifier_lm_head, model.verifier_norm):
            frozen.to(torch.bfloat16 if on_gpu else torch.float32)
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5, fused=on_gpu)
        fwd = torch.compile(model.forward) if "compile" in variant else model.forward
        kw = dict(ttt_steps=3, ttt_step_loss_decay=1.0, loss_config=resolve_loss_config("kl_div", "eager"))

        def step(batch=gpu):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
                _, loss, _m = fwd(**batch, **kw)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        t = time.time()
        step()
        sync()
        first = time.time() - t
        if "compile" in variant:  # where the compile time went (seconds, summed over this process's graphs so far)
            from torch._dynamo.utils import compile_times
            names, values = compile_times(repr="csv", aggregate=True)
            top = sorted(((float(v), k) for k, v in zip(names, values)), reverse=True)[:30]
            print("compile seconds:", ", ".join(f"{k} {v:.1f}" for v, k in top), flush=True)
        for _ in range(3):
            step()
        sync()
        on_gpu and torch.cuda.reset_peak_memory_stats()
        t = time.time()
        for _ in range(args.steps):
            step()
        sync()
        dt = (time.time() - t) / args.steps
        results[variant] = {"ms_per_step": 1000 * dt, "tokens_per_s": tokens / dt, "first_step_s": first,
                            "peak_GB": torch.cuda.max_memory_allocated() / 1e9 if on_gpu else None}
        t, n = time.time(), 0
        for fresh in packed(batches[:args.steps]):  # the same step on each new batch from the loader, as in training
            fresh.pop("tokens")
            step(fresh)
            n += 1
        sync()
        results[variant]["with_loader_ms_per_step"] = 1000 * (time.time() - t) / n
        print(variant, results[variant], flush=True)
        if args.out and variant == args.variants[-1]:
            os.makedirs(args.out, exist_ok=True)
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
                for _ in range(3):
                    step()
                sync()
            table = prof.key_averages().table(sort_by="self_cuda_time_total" if on_gpu else "self_cpu_time_total", row_limit=45, max_name_column_width=90)
            print(table)
            open(os.path.join(args.out, f"profile_{variant}.txt"), "w").write(table)
            prof.export_chrome_trace(os.path.join(args.out, f"trace_{variant}.json"))
        model = opt = fwd = None  # frees them (step() holds them too)
        on_gpu and torch.cuda.empty_cache()
    if args.out:
        json.dump(results, open(os.path.join(args.out, "profile.json"), "w"), indent=2)


if __name__ == "__main__":
    main()
