#!/usr/bin/env python3
"""bfloat16 against float32 on the CPU, side by side in one run: a matrix product of the draft head's
shape, Muon's orthogonalization (torch's bfloat16 one against 04's float32 one), stage 03 on the same prepared rows, and stage 04 on the same extracted rows (eager, and with
--compile --compile-wait). On a CPU with AMX or AVX512-BF16, bfloat16 is the default of 03 and 04 (common/verifier.py:
compute_dtype); this measures what that buys.

  python bench/bench_cpu_dtype.py --data-dir runs/demo400/data --steps 60 --work /tmp/bench_dtype
  python bench/bench_cpu_dtype.py --kernels-only
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ("float32", "bfloat16")


def matmul_gflops(dtype: str, m=1024, k=576, n=8192, reps=20) -> float:
    a, b = torch.randn(m, k, dtype=getattr(torch, dtype)), torch.randn(k, n, dtype=getattr(torch, dtype))
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t) / 1e9


def muon_orthogonalizations_per_s(dtype: str, hidden=576, mlp=1536, kv=192, reps=1) -> float:
    """Muon's Newton-Schulz over the matrices of SmolLM2's standard draft (fc, attention, MLP): torch's, in
    bfloat16, against common/train.py's float32 one, which 04 uses where the CPU has no bfloat16 units."""
    import torch.optim._muon as muon
    sys.path.insert(0, ROOT)
    from common.train import orthogonalize_float32
    run = muon._zeropower_via_newtonschulz if dtype == "bfloat16" else orthogonalize_float32  # noqa: SLF001 - torch.optim.Muon's own step
    shapes = [(hidden, 3 * hidden), (hidden, 2 * hidden), (kv, 2 * hidden), (kv, 2 * hidden), (hidden, hidden),
              (mlp, hidden), (mlp, hidden), (hidden, mlp)]
    grads = [torch.randn(*s) for s in shapes]
    t = time.perf_counter()
    for _ in range(reps):
        for g in grads:
            run(g, (3.4445, -4.775, 2.0315), 5, 1e-7)
    return reps / (time.perf_counter() - t)


def stage(args: list[str], log: str) -> float:
    t = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run([sys.executable, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t


def extract_tokens_per_s(data: str, work: str, config: str, dtype: str) -> float:
    """03 on a copy of the prepared rows: their tokens over the stage's wall time (the model load included)."""
    out = os.path.join(work, f"03_{dtype}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(os.path.join(data, "prepared"), os.path.join(out, "prepared"))
    took = stage(["03_extract_hidden_states.py", "--config", config, "--data-dir", out, "--dtype", dtype], out + ".log")
    tokens = sum(json.load(open(os.path.join(d, "manifest.json")))["counts"]["total_tokens"]
                 for d in (os.path.join(out, "prepared", x) for x in os.listdir(os.path.join(out, "prepared"))))
    return tokens / took


def train_tokens_per_s(data: str, work: str, config: str, dtype: str, steps: int, compiled: bool) -> float:
    """04 for `steps` steps: the mean of its logged tokens/s from the second half of the run on."""
    out = os.path.join(work, f"04_{dtype}{'_compiled' if compiled else ''}")
    shutil.rmtree(out, ignore_errors=True)
    stage(["04_train.py", "--config", config, "--data-dir", data, "--output-dir", out, "--max-steps", str(steps),
           "--log-every", "10", "--dtype", dtype, *(["--compile", "--compile-wait"] if compiled else [])], out + ".log")
    rates = [(int(m[1]), float(m[2].replace(",", ""))) for m in
             re.finditer(r"step (\d+)/\d+ .*? ([\d,]+) tok/s", open(out + ".log").read())]
    return sum(r for s, r in rates if s > steps // 2) / max(1, sum(1 for s, _ in rates if s > steps // 2))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="a data dir that 01-03 filled (prepared rows, states, vocab)")
    p.add_argument("--kernels-only", action="store_true", help="only the matrix product and Muon rows (no --data-dir)")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--steps", type=int, default=60, help="04 steps per run")
    p.add_argument("--work", default="/tmp/bench_dtype")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if not (args.data_dir or args.kernels_only):
        p.error("give --data-dir, or --kernels-only")
    os.makedirs(args.work, exist_ok=True)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    print(f"CPU: {torch.get_num_threads()} threads, AMX {amx}, AVX512-BF16 {avx512_bf16}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}")
    rows = {"matmul GFLOP/s (1024x576 @ 576x8192)": {d: matmul_gflops(d) for d in DTYPES},
            "Muon orthogonalizations/s (a draft's matrices)": {d: muon_orthogonalizations_per_s(d) for d in DTYPES}}
    if not args.kernels_only:
        data = os.path.abspath(args.data_dir)
        rows.update({
            "03 tokens/s": {d: extract_tokens_per_s(data, args.work, args.config, d) for d in DTYPES},
            "04 tokens/s, eager": {d: train_tokens_per_s(data, args.work, args.config, d, args.steps, False) for d in DTYPES},
            "04 tokens/s, --compile --compile-wait": {
                d: train_tokens_per_s(data, args.work, args.config, d, args.steps, True) for d in DTYPES}})
    print(f"\n{'':48} {'float32':>10} {'bfloat16':>10} {'ratio':>7}")
    for name, r in rows.items():
        print(f"{name:48} {r['float32']:10,.2f} {r['bfloat16']:10,.2f} {r['bfloat16'] / r['float32']:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"amx": amx, "avx512_bf16": avx512_bf16, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
