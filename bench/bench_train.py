#!/usr/bin/env python3
"""Stage 04 against speculators' own Trainer on the same data and draft config, side by side in one run.

  python bench/bench_train.py --shape llama-3.1-8b --rows 64 --seq-len 2048 --steps 60 --work /tmp/bt

Builds a random verifier of a real shape (only what the draft reads: config, embedding, lm_head,
final norm) and random hidden states of real shapes in the pipeline's formats, then trains:
  ours               04_train.py (eager forward)
  ours+compile       04_train.py --compile (eager steps until the compiled forward is built beside them)
  ours+compile-wait  04_train.py --compile --compile-wait (compiled before the first step)
  speculators        speculators.train.trainer.Trainer with its own ArrowDataset/FileTransfer loader,
                     shift_batch, packing sampler and (on CUDA) its torch.compile'd forward
each in its own process, and prints tokens/s, the ratio, MFU, peak memory and the time from launch
to the first step. Both use sdpa attention and the eager loss (the fused loss fails inside
torch.compile on torch 2.11). Speed does not depend on weight values.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, datasheet


def make_inputs(work: str, shape: str, rows: int, seq_len: int, draft_vocab: int) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from bench_extract import SHAPES
    from common.rows import save_row
    from common.manifest import atomic_write_json, prepared_fingerprint
    from common.verifier import default_aux_layers, verifier_fingerprint
    if os.path.exists(os.path.join(work, "ready")):
        return
    config = LlamaConfig(**{**SHAPES[shape], "tie_word_embeddings": False})
    H, V = config.hidden_size, config.vocab_size
    verifier = os.path.join(work, "verifier")
    os.makedirs(verifier, exist_ok=True)
    config.save_pretrained(verifier)
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(V, H, generator=g, dtype=torch.float32).bfloat16() * 0.02,
               "lm_head.weight": torch.randn(V, H, generator=g).bfloat16() * 0.02,
               "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}, os.path.join(verifier, "model.safetensors"))
    import datasets
    # one random row repeated, its states file hard-linked: speed does not depend on values, and a
    # long-context run needs as many rows as steps (one epoch, no checkpoint inside the timing) without their disk
    ids = [torch.randint(0, V, (seq_len,), generator=g).tolist()] * rows
    prepared = os.path.join(work, "data", "prepared", f"rows_0-{rows}")
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[1] * seq_len] * rows,
                                     "seq_len": [seq_len] * rows, "conversation_id": list(range(rows))})
    ds.set_format("torch")  # as stage 01 and speculators' prepare-data save it
    ds.save_to_disk(prepared)
    aux = default_aux_layers(config.num_hidden_layers)
    hs = os.path.join(work, "data", "hidden_states", f"rows_0-{rows}")
    os.makedirs(hs, exist_ok=True)
    save_row(os.path.join(hs, "hs_0.safetensors"), ids[0], torch.randn(seq_len, len(aux) + 1, H, generator=g).bfloat16(),
             [1] * seq_len)
    for i in range(1, rows):
        os.link(os.path.join(hs, "hs_0.safetensors"), os.path.join(hs, f"hs_{i}.safetensors"))
    inputs = {"tokenizer_hash": "bench", "verifier_hash": verifier_fingerprint(config), "prepared_dir": prepared}
    atomic_write_json(os.path.join(prepared, "manifest.json"), {"stage": "prepare", "inputs": inputs,
                                                                "counts": {"rows_hash": f"bench-{rows}x{seq_len}"}})
    atomic_write_json(os.path.join(hs, "manifest.json"), {
        "stage": "hidden_states", "inputs": {**inputs, "prepared_manifest_hash": prepared_fingerprint(prepared)}, "aux_layers": aux, "final_layer": config.num_hidden_layers,
        "hidden_size": H, "num_hidden_layers": config.num_hidden_layers})
    vm = os.path.join(work, "data", "vocab_mapping")
    os.makedirs(vm, exist_ok=True)
    chosen = np.sort(np.random.default_rng(0).choice(V, draft_vocab, replace=False))
    t2d = np.zeros(V, dtype=bool)
    t2d[chosen] = True
    np.save(os.path.join(vm, "d2t.npy"), (chosen - np.arange(draft_vocab)).astype(np.int64))
    np.save(os.path.join(vm, "t2d.npy"), t2d)
    atomic_write_json(os.path.join(vm, "manifest.json"), {"stage": "vocab_mapping", "inputs": inputs})
    open(os.path.join(work, "ready"), "w").close()


def run_ours(work: str, args, variant: str) -> dict:
    attn = "simple_flex_attention" if "flex" in variant else "sdpa"
    flags = (["--compile"] if "compile" in variant else []) + (["--compile-wait"] if "wait" in variant else [])
    out = os.path.join(work, "out_" + variant.replace("+", "_"))
    subprocess.run(["rm", "-rf", out])
    cmd = [sys.executable, os.path.join(ROOT, "04_train.py"), "--verifier-path", os.path.join(work, "verifier"),
           "--data-dir", os.path.join(work, "data"), "--output-dir", out, "--max-steps", str(args.steps),
           "--epochs", "1000", "--pack-tokens", str(args.seq_len), "--ttt-steps", "3", "--val-ratio", "0",
           "--log-every", "10", "--num-workers", str(args.num_workers), "--attn-impl", attn, "--loss-implementation", "eager",
           "--lr", "1e-4"] + flags
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout
    with open(out + ".txt", "w") as f:  # the run's own log, kept for reading
        f.write(log + proc.stderr)
    if proc.returncode:  # out of memory at a long --seq-len is a result, not the end of the bench
        return {"error": (proc.stdout + proc.stderr).strip().splitlines()[-1][-300:]}

    def since_launch(pattern):
        hit = re.search(r"^(\S+ \S+) .*" + pattern, log, re.M)
        return (time.mktime(time.strptime(hit.group(1), "%Y-%m-%d %H:%M:%S")) - start) if hit else None
    records = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"train"' in x]
    switch = re.search(r"compiled forward in use from step (\d+)", log)
    compiled_from = int(switch.group(1)) if switch else None
    # steady state: past the first two log intervals and the switch to the compiled forward, leaving out
    # the intervals that also wrote an epoch's checkpoint (~9 s for this draft)
    records = [r for r, before in zip(records, [records[0]] + records) if r["epoch"] == before["epoch"]]
    steady = [r for r in records[2:] if compiled_from is None or r["step"] - 10 >= compiled_from] or records[2:] or records
    mem = re.findall(r"gpu_peak ([\d.]+)GB", log)
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady), "steady_steps": len(steady) * 10,
            "launch_to_first_step_s": since_launch("first step done"),
            "launch_to_compiled_s": since_launch("compiled forward in use"), "compiled_from_step": compiled_from,
            "peak_gpu_GB": float(mem[-1]) if mem else None}


def speculators_worker(work: str, steps: int, seq_len: int, result_path: str) -> None:
    """speculators' own training path, untouched (run in a fresh process)."""
    launch = time.time()
    import torch
    from transformers import AutoConfig

    from hs_connectors import FileTransfer
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.trainer import Trainer, TrainerConfig
    import numpy as np
    verifier = os.path.join(work, "verifier")
    vm = os.path.join(work, "data", "vocab_mapping")
    t2d, d2t = torch.from_numpy(np.load(os.path.join(vm, "t2d.npy"))), torch.from_numpy(np.load(os.path.join(vm, "d2t.npy")))
    layer_config = create_transformer_layer_config(verifier, 1, "llama", None, 0, [0])
    model = Eagle3DraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier, draft_vocab_size=int(d2t.numel()),
        norm_before_residual=True, ttt_steps=3, draft_attn_impl="sdpa")
    rows = [d for d in os.listdir(os.path.join(work, "data", "prepared"))][0]
    dataset = ArrowDataset(max_len=seq_len, datapath=os.path.join(work, "data", "prepared", rows),
                           transfer=FileTransfer(__import__("pathlib").Path(work, "data", "hidden_states", rows)),
                           on_missing="raise")
    H = AutoConfig.from_pretrained(verifier).hidden_size
    loader = _setup_dataloader(dataset, seq_len, H, num_workers=4, num_target_layers=3, preprocess=shift_batch)
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager",
                                                          ttt_steps=3, ttt_step_loss_decay=1.0)
    trainer = Trainer(model, TrainerConfig(lr=1e-4, num_epochs=1000, save_path=os.path.join(work, "spec_out"),
                                           train_call_kwargs=train_kwargs, max_steps=steps, log_freq=10), loader)
    stamps = []
    skip = min(20, steps // 3)

    def on_step():  # synchronize only where a time is read, so the host may run ahead elsewhere
        if len(stamps) in (0, skip, steps - 1):
            torch.cuda.synchronize()
        stamps.append(time.time())
    loop_start = time.time()
    epoch = 0
    while trainer.global_step < steps:
        trainer.train_epoch(epoch, step_callback=on_step)
        epoch += 1
    tokens = seq_len - 1  # one packed sequence per step (rows of seq_len, shifted by one)
    with open(result_path, "w") as f:
        json.dump({"tokens_per_s": tokens * (len(stamps) - 1 - skip) / (stamps[-1] - stamps[skip]),
                   "launch_to_first_step_s": stamps[0] - launch, "loop_to_first_step_s": stamps[0] - loop_start,
                   "peak_gpu_GB": torch.cuda.max_memory_allocated() / 1e9}, f)


def draft_flops_per_token(work: str, draft_vocab: int) -> tuple[float, float]:
    """Two counts of matmul FLOPs per token (attention's own products left out in both):
    the issue's: 6 x (trainable + frozen draft lm_head) parameters per TTT step, plus the verifier head's forward;
    the work needed: fc runs once, not per TTT step, and the frozen lm_head needs no weight gradient (4, not 6)."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(os.path.join(work, "verifier"))
    H, I = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (H // c.num_attention_heads)
    layer = 2 * H * H + 2 * (2 * H * kv) + H * H + 3 * H * I  # q from 2H, k/v from 2H, o, mlp
    fc = 3 * H * H
    head = draft_vocab * H
    return 3 * 6 * (layer + fc + head) + 2 * head, 3 * 6 * layer + 6 * fc + 3 * 4 * head + 2 * head


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seq-len", type=int, nargs="+", default=[2048],
                   help="tokens per packed sequence; several give the long-context curve (inputs of each in WORK/lenN)")
    p.add_argument("--clean", action="store_true", help="delete each length's inputs after its runs (disk)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--work", default="/tmp/bench_train")
    p.add_argument("--only", choices=["ours", "ours+compile", "ours+compile-wait", "ours+compile-wait+flex", "speculators"],
                   nargs="+", default=["ours", "ours+compile", "ours+compile-wait", "speculators"])
    p.add_argument("--num-workers", type=int, default=4, help="data loader workers for our runs")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--speculators-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.speculators_worker:
        return speculators_worker(args.work, args.steps, args.seq_len[0], args.speculators_worker)
    curve = {}
    for seq_len in args.seq_len:
        one = argparse.Namespace(**{**vars(args), "seq_len": seq_len,
                                    "work": args.work if len(args.seq_len) == 1 else f"{args.work}/len{seq_len}"})
        curve[seq_len] = bench_one(one)
        if args.clean:
            subprocess.run(["rm", "-rf", one.work])
    if len(curve) > 1:  # the long-context curve: every run against the first at each length
        print(f"\n{args.shape} draft, 3 TTT steps: tokens/s and peak GPU memory against the packed length")
        print(f"{'tokens':>7s} " + " ".join(f"{n:>34s}" for n in args.only))
        for seq_len, results in curve.items():
            cells = [("failed (" + r["error"][:24] + ")") if "error" in r else
                     f"{r['tokens_per_s']:,.0f} tok/s {r['peak_gpu_GB'] or 0:.1f} GB" for r in results.values()]
            print(f"{seq_len:7d} " + " ".join(f"{c:>34s}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "steps": args.steps, "results": curve}, f, indent=2)


def bench_one(args) -> dict:
    """Every run of --only at one --seq-len, side by side; prints its table and returns the results."""
    make_inputs(args.work, args.shape, args.rows, args.seq_len, args.draft_vocab)
    results = {}
    for name in args.only:
        if name == "speculators":
            path = os.path.join(args.work, "spec_result.json")
            proc = subprocess.run([sys.executable, __file__, "--speculators-worker", path, "--work", args.work,
                                   "--steps", str(args.steps), "--seq-len", str(args.seq_len)],
                                  capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                continue
            results[name] = json.load(open(path))
        else:
            results[name] = run_ours(args.work, args, name)
        print(name, results[name], flush=True)
    if not any("error" not in r for r in results.values()):
        return results
    flops, needed = draft_flops_per_token(args.work, args.draft_vocab)
    base = results.get("speculators", {}).get("tokens_per_s")
    print(f"\n{args.shape} draft, {args.seq_len}-token packed sequences, 3 TTT steps, {args.steps} steps")
    print(f"MFU: {flops / 1e9:.2f} GFLOP/token (the issue's 6-FLOPs-per-parameter count); "
          f"MFU needed: {needed / 1e9:.2f} GFLOP/token (fc once, no weight gradient for the frozen head)")
    print(f"{'run':22s} {'tokens/s':>10s} {'vs spec':>8s} {'MFU':>6s} {'needed':>7s} {'peak GB':>8s} {'first step':>10s} "
          f"{'compiled':>9s} {'from step':>9s}")
    seconds = lambda v: "-" if v is None else f"{v:.1f}s"  # noqa: E731
    for name, r in results.items():
        if "error" in r:
            print(f"{name:22s} failed: {r['error']}")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        r["mfu"], r["mfu_needed"] = r["tokens_per_s"] * flops / PEAK_BF16, r["tokens_per_s"] * needed / PEAK_BF16
        print(f"{name:22s} {r['tokens_per_s']:10,.0f} {ratio:>8s} {r['mfu']:6.1%} {r['mfu_needed']:7.1%} "
              f"{r['peak_gpu_GB'] or 0:8.1f} {seconds(r.get('launch_to_first_step_s')):>10s} "
              f"{seconds(r.get('launch_to_compiled_s')):>9s} {r.get('compiled_from_step') or '-':>9}")
    return results

if __name__ == "__main__":
    main()
