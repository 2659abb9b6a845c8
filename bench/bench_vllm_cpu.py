"""vLLM on the CPU: 05_evaluate.py with the engine in its own process (`load_vllm`'s default on a CPU, one rank)
against vLLM's own layout (an engine-core process and a worker process, VLLM_ENABLE_V1_MULTIPROCESSING=1), side by
side on the same command, alternating, each timed end to end; the two reports must hold the same counts.

    python bench/bench_vllm_cpu.py --draft-path CKPT --data-dir D [--num-prompts 4 --max-new-tokens 32 --repeats 2]

CKPT: a servable draft (04's checkpoints/best); D: the data root it trained on (05 leaves its conversations out).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft-path", required=True, help="a servable draft folder")
    parser.add_argument("--data-dir", required=True, help="the data root the draft trained on")
    parser.add_argument("--num-prompts", type=int, default=4, help="held-out conversations 05 answers")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--repeats", type=int, default=2, help="runs each way")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench_vllm_cpu")
    ways = {"spawned (vLLM's layout)": "1", "in process": "0"}
    times, reports = {w: [] for w in ways}, {}
    for r in range(args.repeats):
        for way, flag in ways.items():
            out = os.path.join(work, f"{flag}_{r}")
            t = time.time()
            subprocess.run([sys.executable, os.path.join(ROOT, "05_evaluate.py"), "--draft-path", args.draft_path,
                            "--data-dir", args.data_dir, "--output-dir", out, "--num-prompts", str(args.num_prompts),
                            "--max-new-tokens", str(args.max_new_tokens), "--max-turns", "1"],
                           env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": flag}, check=True,
                           capture_output=True)
            times[way].append(time.time() - t)
            with open(os.path.join(out, "eval", "eval.json")) as f:
                reports[way] = json.load(f)
    (a, ra), (b, rb) = reports.items()
    counts = [{n: d["per_conversation"] for n, d in r["drafts"].items()} for r in (ra, rb)]
    assert counts[0] == counts[1], "the two layouts measured different acceptance"
    print(f"{'05 (baseline + one draft)':26} {'wall (s)':>9} {'baseline tok/s':>15}")
    for way in ways:
        print(f"{way:26} {sum(times[way]) / len(times[way]):9.1f} {reports[way]['baseline_tokens_per_s']:15.1f}")
    print(f"in process: {sum(times[a]) / sum(times[b]):.2f}x faster end to end than spawned; the same counts")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
