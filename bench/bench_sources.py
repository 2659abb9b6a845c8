#!/usr/bin/env python3
"""04's sources of hidden states side by side in one run, on the same rows: disk (03's files), colocated (the
verifier in the training process) and server (serve_states.py's vLLM server, --num-workers requests in flight).
Prints each one's training tokens/s, the share of the time the loop waited for states, the ratio to disk, and the
bytes of states disk needs that the others do not. On a GPU machine without vLLM, pass --sources disk colocated.

  python bench/bench_sources.py --data-dir runs/demo/data --steps 40 --work /tmp/bench_sources
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(source: str, args, out: str, url: str | None) -> dict:
    """One 04 run; the mean of its logged tokens/s and wait share after the first logged interval (warm-up)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, os.path.join(ROOT, "04_train.py"), "--data-dir", args.data_dir, "--output-dir", out,
           "--max-steps", str(args.steps), "--log-every", str(args.log_every), "--val-ratio", "0",
           "--states-from", source, "--num-workers", str(args.workers), *args.flags.split(),
           *(["--states-url", url] if url else [])]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in records) / len(records),
            "wait": sum(r["states_wait_share"] for r in records) / len(records)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="a data dir with 01's rows, 02's mapping and 03's states")
    p.add_argument("--sources", nargs="+", default=["disk", "colocated", "server"], help="sources to measure")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--log-every", type=int, default=5, help="steps per measured interval")
    p.add_argument("--workers", type=int, default=4, help="04's --num-workers (the server's requests in flight)")
    p.add_argument("--flags", default="", help="more 04 flags, for example '--pack-tokens 1024 --dtype float32'")
    p.add_argument("--server-flags", default="", help="more serve_states.py flags, for example '--dtype float32'")
    p.add_argument("--work", default="/tmp/bench_sources", help="scratch folder for the runs")
    args = p.parse_args()
    results, server = {}, None
    try:
        for source in args.sources:
            url = None
            if source == "server":
                server = subprocess.Popen([sys.executable, os.path.join(ROOT, "serve_states.py"), "--port", "8123",
                                           *args.server_flags.split()], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
                url = next((line.split("=", 1)[1].strip() for line in server.stdout
                            if line.startswith("STATES_URL=")), None)
                if url is None:
                    sys.exit("serve_states.py stopped before it answered")
                threading.Thread(target=server.stdout.read, daemon=True).start()  # its log must not fill the pipe
            results[source] = train(source, args, os.path.join(args.work, source), url)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=120)
    states = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(args.data_dir, "hidden_states"))
                 for f in fs)
    print(f"{'source':10} {'tokens/s':>10} {'waited':>7} {'vs disk':>8}")
    for source, r in results.items():
        ratio = r["tokens_per_s"] / results["disk"]["tokens_per_s"] if "disk" in results else float("nan")
        print(f"{source:10} {r['tokens_per_s']:10,.0f} {r['wait']:7.0%} {ratio:7.2f}x")
    print(f"states on disk for the disk source: {states / 1e9:.2f} GB; the others keep none")


if __name__ == "__main__":
    main()
