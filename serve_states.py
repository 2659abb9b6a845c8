#!/usr/bin/env python3
"""A vLLM server that computes the verifier's hidden states for 04_train.py --states-from server: `vllm serve` with
03's extraction settings; waits until it answers, prints its URL, and runs until stopped (Ctrl-C or SIGTERM).
The trainer must see --storage (the server writes each request's states there): one machine, or a shared folder."""
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from common.cli import add_verifier_flags, run_stage, stage_parser
from common.config import number
from common.errors import UserError
from common.log import log
from common.verifier import (check_aux_layers, compute_dtype, default_aux_layers, load_text_config,
                             remote_code_needed, resolve_verifier)

STAGE = "serve_states"
ROOT = os.path.dirname(os.path.abspath(__file__))


def build_parser():
    p = stage_parser(STAGE, __doc__)
    add_verifier_flags(p)
    p.add_argument("--layers", type=number(int, 0), nargs="+", help="aux layer ids (default: 03's, 2 N/2 N-3); the "
                                                                    "final layer is always served as the last")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: trainers on other machines)")
    p.add_argument("--port", type=number(int, 1, 65535), default=8100, help="port to listen on")
    p.add_argument("--storage", help="folder the states are written to and read from by the trainer (default: a new "
                                     "folder in /dev/shm, a RAM disk)")
    p.add_argument("--max-model-len", type=number(int, 2), default=4096, help="longest row, in tokens")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                   help="compute dtype (default: compute_dtype's rule, common/verifier.py)")
    p.add_argument("--tensor-parallel-size", type=number(int, 1), default=1, help="GPUs the verifier is split over")
    p.add_argument("--gpu-memory-utilization", type=number(float, 0, 1, low_open=True), default=0.9,
                   help="share of each GPU's memory vLLM may take (leave room for a trainer on the same GPUs)")
    p.add_argument("--ready-timeout", type=number(int, 1), default=1200, help="seconds to wait for the server to answer")
    return p


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5):
            return True
    except OSError:
        return False


def run(args):
    import torch
    from common.states_server import serve_command
    verifier = resolve_verifier(args.verifier_path)
    trust = remote_code_needed(verifier, args.trust_remote_code)
    n = load_text_config(verifier, trust).num_hidden_layers
    aux = check_aux_layers(args.layers, n) if args.layers else default_aux_layers(n)
    storage = args.storage or tempfile.mkdtemp(prefix=f"eagle3-states-{args.port}-",
                                               dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.makedirs(storage, exist_ok=True)
    dtype = args.dtype or compute_dtype("cuda" if torch.cuda.is_available() else "cpu")
    command = serve_command(verifier, [*aux, n], storage, args.host, args.port, args.max_model_len, dtype,
                            args.tensor_parallel_size, args.gpu_memory_utilization, trust)
    url = f"http://{'127.0.0.1' if args.host == '0.0.0.0' else args.host}:{args.port}"
    if answers(url):
        raise UserError(f"something already answers at {url}: stop it, or pass another --port")
    log.info(f"starting vLLM: layers {aux} + final {n}, states in {storage}")
    # the server imports the connector from common/: the repository goes on its path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen(command, env=env)
    try:
        deadline = time.time() + args.ready_timeout
        while not answers(url):
            if server.poll() is not None:
                raise UserError(f"vllm serve exited with code {server.returncode} before it answered; its log above "
                                "says why")
            if time.time() > deadline:
                raise UserError(f"vllm serve did not answer at {url} within {args.ready_timeout} s; raise "
                                "--ready-timeout, or see its log above")
            time.sleep(2)
        log.info(f"serving the states of {verifier} at {url}")
        print(f"STATES_URL={url}", flush=True)  # what 04_train.py --states-url takes
        code = server.wait()
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=60)
    if code:
        raise UserError(f"vllm serve exited with code {code}; its log above says why")
    return f"the server at {url} stopped"


if __name__ == "__main__":
    run_stage(STAGE, build_parser(), run, sys.argv[1:])
