#!/usr/bin/env python3
"""Stage 03 throughput against the bare forward pass of the same model on the same batches, in one run.

A random model built from a real config (speed does not depend on weight values). Phases, each on the
same token-budget batches:
  bare       model forward only (no hooks, no copies): the ceiling
  sync-copy  forward + the saved layers copied to the host synchronously (the plain way), no disk
  ours       the stage's own path: hooks, pinned async copies, writer threads, files on disk
  disk-only  the same files written from host memory with no compute: the disk's bound
Usage: python bench/bench_extract.py --shape llama-3.1-8b --rows 96 --seq-len 2048 --batch-tokens 16384
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.extract import RowWriter, TransformersBackend, extract_transformers, plan_batches
from common.rows import row_file
from common.verifier import default_aux_layers

SHAPES = {  # from the models' published config.json files
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device, fn):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="smollm2-135m")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--out-dir", default=None, help="where files are written (default: a temp folder)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    from transformers import AutoModel, LlamaConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(**SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModel.from_config(config, dtype=dtype).eval()
    n = config.num_hidden_layers
    aux = default_aux_layers(n)
    gen = torch.Generator().manual_seed(0)
    rows = {i: {"input_ids": torch.randint(0, config.vocab_size, (args.seq_len,), generator=gen).tolist(),
                "loss_mask": [1] * args.seq_len} for i in range(args.rows)}
    batches = plan_batches({i: args.seq_len for i in rows}, args.batch_tokens)
    tokens = args.rows * args.seq_len
    out = args.out_dir or tempfile.mkdtemp(prefix="bench-hs-")
    os.makedirs(out, exist_ok=True)

    def ids(batch):
        return torch.tensor([rows[i]["input_ids"] for i in batch], device=device)

    @torch.no_grad()
    def bare():
        for b in batches:
            x = ids(b)
            model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)

    with torch.no_grad():  # warm-up: kernels, allocator
        x = ids(batches[0])
        model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    results = {"bare": timed(device, bare)}

    backend = TransformersBackend(model, aux, n, device)

    def sync_copy():
        for b in batches:
            backend.states([rows[i]["input_ids"] for i in b], 0).cpu()
    results["sync-copy"] = timed(device, sync_copy)

    # set-up, as in the stage: writer threads and pinned buffers exist before the first batch
    writer = RowWriter(args.writer_threads, capacity=args.batch_tokens * (len(aux) + 1) * config.hidden_size)

    def ours():
        extract_transformers(backend, batches, rows, set(rows), out, writer, 0, None)
        writer.close()
    results["ours"] = timed(device, ours)
    file_bytes = sum(os.path.getsize(row_file(out, i)) for i in rows)

    host = torch.zeros(args.seq_len, len(aux) + 1, config.hidden_size, dtype=torch.bfloat16)
    disk_dir = tempfile.mkdtemp(prefix="bench-disk-", dir=os.path.dirname(os.path.abspath(out)))

    def disk_only():
        writer = RowWriter(args.writer_threads)
        for start in range(0, args.rows, 8):
            writer.submit([(row_file(disk_dir, i), rows[i]["input_ids"], host, rows[i]["loss_mask"])
                           for i in range(start, min(start + 8, args.rows))])
        writer.close()
    results["disk-only"] = timed(device, disk_only)
    shutil.rmtree(disk_dir, ignore_errors=True)
    if not args.out_dir:
        shutil.rmtree(out, ignore_errors=True)

    rate = {k: tokens / v for k, v in results.items()}
    ideal = (len(aux) + 1) * config.hidden_size * 2
    bound = "compute" if rate["bare"] < rate["disk-only"] else "disk"
    report = {"shape": args.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "dtype": str(dtype), "rows": args.rows, "seq_len": args.seq_len, "batch_tokens": args.batch_tokens,
              "tokens_per_s": {k: round(v) for k, v in rate.items()},
              "ours_vs_bare": round(rate["ours"] / rate["bare"], 3),
              "ours_vs_min_bound": round(rate["ours"] / min(rate["bare"], rate["disk-only"]), 3),
              "sync_copy_vs_bare": round(rate["sync-copy"] / rate["bare"], 3), "bound": bound,
              "bytes_per_token": round(file_bytes / tokens, 1), "ideal_bytes_per_token": ideal,
              "disk_GB_per_s": round(file_bytes / results["disk-only"] / 1e9, 2)}
    print(f"{args.shape} on {report['device']} ({dtype}), {args.rows} x {args.seq_len} tokens, "
          f"batches of {args.batch_tokens} tokens")
    for k in results:
        print(f"  {k:10s} {rate[k]:12,.0f} tokens/s  ({rate[k] / rate['bare']:.2f} of bare)")
    print(f"  ours / bare = {report['ours_vs_bare']:.3f}; ours / min(bare, disk) = {report['ours_vs_min_bound']:.3f}; "
          f"bound: {bound}")
    print(f"  bytes per token {report['bytes_per_token']} vs (n_aux+1)*H*2 = {ideal} "
          f"({report['bytes_per_token'] / ideal:.3f}); disk {report['disk_GB_per_s']} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
