"""The tests' stage runs: a fresh `python STAGE.py` against a fork of tests/stage_server.py (torch, transformers,
speculators and vLLM imported once), side by side on the same commands, alternating, each timed end to end.

    python bench/bench_stage_server.py --data-dir D [--repeats 2]

D: a data root that 01-03 wrote (the tests' `data` fixture, or `make demo`'s); nothing in it is changed.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from stage_server import StageServer  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="a data root with prepared/, vocab_mapping/, hidden_states/")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each command each way")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench_stage_server")
    commands = {
        "02, a vocabulary mapping": ["02_build_vocab_mapping.py", "--data-dir", args.data_dir, "--draft-vocab-size", "1024",
                                     "--output-dir", f"{work}/out"],
        "04, one training step": ["04_train.py", "--data-dir", args.data_dir, "--output-dir", f"{work}/out", "--max-steps",
                                  "1", "--max-seq-len", "512", "--val-ratio", "0", "--num-workers", "0"],
        "03, a missing data dir (exit 2)": ["03_extract_hidden_states.py", "--data-dir", f"{work}/none"],
    }
    t = time.time()
    server = StageServer()
    assert server.usable(), server.failed
    print(f"stage server ready in {time.time() - t:.1f}s (paid once a test session)")

    def fresh(argv):
        return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True).returncode

    def forked(argv):
        return server.run(argv[0], argv[1:], 1800).returncode

    print(f"{'command':34} {'fresh (s)':>10} {'forked (s)':>11} {'ratio':>6}")
    for name, argv in commands.items():
        times = {"fresh": [], "forked": []}
        for _ in range(args.repeats):
            for way, run in (("fresh", fresh), ("forked", forked)):
                shutil.rmtree(f"{work}/out", ignore_errors=True)
                t = time.time()
                code = run(argv)
                times[way].append(time.time() - t)
                assert code == (2 if "exit 2" in name else 0), (name, way, code)
        a, b = (sum(v) / len(v) for v in times.values())
        print(f"{name:34} {a:10.1f} {b:11.1f} {a / b:5.1f}x")
    server.stop()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
