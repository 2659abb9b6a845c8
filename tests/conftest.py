"""Shared fixtures: the real SmolLM2 verifier, real ShareGPT rows, run through the real stage scripts.

Stages run as processes with a user's command line and environment; the pipeline fixtures are built once per
session and shared (the vLLM tests start their own engines, one per configuration). A stage run is forked from
tests/stage_server.py, an interpreter that has imported torch, transformers, speculators and vLLM once (a fresh one
spends 10-30 s on that here), unless it needs its own environment or a memory limit, or EAGLE3_TEST_FORK=0.
"""
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from stage_server import StageServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("EAGLE3_CACHE", os.path.join(ROOT, ".cache", "eagle3"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(ROOT, ".cache", "vllm"))

ROWS, SEQ = 64, 256          # small real data: ~14K tokens, a minute of extraction on 2 cores
DRAFT_VOCAB = 4096


# A guard against a hung stage only: a busy 2-core machine can take several times the usual minutes
HANG_GUARD_S = 3600


SERVER = None


def pytest_collection_finish(session):
    global SERVER
    unit = os.path.join(ROOT, "tests", "unit")
    if os.environ.get("EAGLE3_TEST_FORK", "1") != "0" and any(not str(i.path).startswith(unit) for i in session.items):
        SERVER = StageServer()


def pytest_sessionfinish(session):
    if SERVER:
        SERVER.stop()


def stage(script: str, *args, check: bool = True, timeout: int = HANG_GUARD_S,
          env: dict | None = None, memory_limit: int | None = None) -> subprocess.CompletedProcess:
    """Run a numbered script (with `env` added to the environment, and with `memory_limit` bytes of
    heap and anonymous memory at most: RLIMIT_DATA, a real limit the allocator meets); return the
    completed process."""
    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_DATA, (memory_limit, memory_limit))
    if env is None and memory_limit is None and SERVER and SERVER.usable():
        proc = SERVER.run(script, args, timeout)
    else:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
                              preexec_fn=limit if memory_limit else None)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def assert_bad_inputs(script: str, cases: list, folder_args) -> None:
    """Each (args, words) case run as `script *folder_args(i) *args`, two at a time (one a core: the runs are
    independent, each in its own folder, and spend most of their time importing); each answered as assert_user_error
    checks, naming its words."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda i: stage(script, *folder_args(i), *cases[i][0], check=False), range(len(cases))))
    for proc, (_, words) in zip(procs, cases):
        assert_user_error(proc, words)


COVERED = Counter()  # faults the suite injected, printed at its end


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"fault injection: {COVERED['kill']} stage runs killed (SIGKILL/SIGTERM) and resumed "
                                f"or checked, {COVERED['bad_input']} bad inputs answered with exit 2 and one line")


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Kill a stage run mid-way (counted for the suite's summary)."""
    proc.send_signal(sig)
    COVERED["kill"] += 1


def start_stage(script: str, *args, quiet: bool = False):
    """A stage run in the background, for a test that signals or pauses it: forked as stage()'s runs are (else a
    fresh process), with Popen's pid, poll, wait, send_signal, communicate and returncode; stdout and stderr as text,
    or thrown away where `quiet`."""
    if SERVER and SERVER.usable():
        return SERVER.start(script, args, HANG_GUARD_S)
    out = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=ROOT, stdout=out,
                            stderr=out, text=True,  # SIGHUP as a login shell leaves it (nohup hands on an ignored one)
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))


def kill_at(argv: list, reached, tries: int = 3) -> None:
    """Start a stage (`stage(*argv)`'s arguments) and SIGKILL it as soon as `reached()` holds; a run that ends first
    (a point inside a short write can be missed) is started again. Fails if the point is never met."""
    for _ in range(tries):
        proc = start_stage(*argv, quiet=True)
        while proc.poll() is None:
            if reached():
                kill(proc)
                proc.wait()
                return
            time.sleep(0.002)
    raise AssertionError(f"{argv[0]} ended {tries} times before its kill point")


def assert_user_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    """Exit code 2, one line on stderr naming the problem, no traceback."""
    COVERED["bad_input"] += 1
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:") or ": error:" in line]
    assert len(errors) == 1, proc.stderr
    for w in words:
        assert w.lower() in errors[0].lower(), errors[0]


@pytest.fixture(scope="session")
def verifier():
    from common.verifier import ensure_default_verifier
    return ensure_default_verifier()


@pytest.fixture(scope="session")
def tokenizer(verifier):
    from common.verifier import load_tokenizer
    return load_tokenizer(verifier)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, verifier):
    """Stages 01-03 on real ShareGPT rows: <data>/prepared, vocab_mapping, hidden_states."""
    data = tmp_path_factory.mktemp("data")
    stage("01_prepare_dataset.py", "--data-dir", data, "--num-samples", ROWS, "--max-seq-len", SEQ)
    stage("02_build_vocab_mapping.py", "--data-dir", data, "--draft-vocab-size", DRAFT_VOCAB)
    # float32: the reference the equivalence tests compare against at float32's precision; bf16 (the default on
    # a CPU with AMX) is compared with it in test_extract.py
    stage("03_extract_hidden_states.py", "--data-dir", data, "--max-tokens-per-batch", 2048, "--dtype", "float32")
    return data


@pytest.fixture(scope="session")
def prepared_dir(data_dir):
    return data_dir / "prepared" / f"rows_0-{ROWS}"


@pytest.fixture(scope="session")
def hs_dir(data_dir):
    return data_dir / "hidden_states" / f"rows_0-{ROWS}"


# AdamW without noise: the sessions' thresholds were measured on this small run (04's defaults are Muon and noise)
TRAIN_ARGS = ["--epochs", 4, "--max-seq-len", 1024, "--lr", 2e-3, "--warmup-steps", 5, "--log-every", 5,
              "--num-workers", 1, "--val-ratio", 0.1, "--norm-before-fc", "--norm-output", "--optimizer", "adamw",
              "--noise-std", 0]


@pytest.fixture(scope="session")
def trained(tmp_path_factory, data_dir):
    """A draft trained by the pipeline; returns its output folder."""
    out = tmp_path_factory.mktemp("train")
    stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, *TRAIN_ARGS)
    return out


@pytest.fixture(scope="session")
def other_verifier(tmp_path_factory, tokenizer):
    """A different (random, small) verifier sharing SmolLM2's tokenizer: hidden 64, 4 layers, a padded
    vocabulary of 49,280 (embedding rows beyond the tokenizer, as Kimi's has)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path_factory.mktemp("other_verifier")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49280, tie_word_embeddings=True,
                         eos_token_id=2, pad_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def foreign_verifier(tmp_path_factory, other_verifier):
    """other_verifier with a real tokenizer that differs from SmolLM2's by one added token."""
    import shutil

    from transformers import AutoTokenizer
    folder = tmp_path_factory.mktemp("foreign_verifier") / "model"
    shutil.copytree(other_verifier, folder)
    tok = AutoTokenizer.from_pretrained(other_verifier)
    tok.add_tokens(["<extra_token_for_test>"])
    tok.save_pretrained(folder)
    return folder


def read_json(path):
    with open(path) as f:
        return json.load(f)


def records(out, split: str) -> list[dict]:
    """04's metrics.jsonl records of one split (train or val)."""
    return [json.loads(line) for line in open(out / "metrics.jsonl") if json.loads(line)["split"] == split]


def stage_module(script: str):
    """A numbered stage script (its name starts with a digit) imported as a module, for its parser and helpers."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"stage_{script}", os.path.join(ROOT, f"{script}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
