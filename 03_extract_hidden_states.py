#!/usr/bin/env python3
"""Stage 03: verifier + prepared rows -> hs_<i>.safetensors per row in <data-dir>/hidden_states/rows_A-B."""
import glob
import json
import os
import shutil
import time

import torch

from common.errors import UserError
from common.cli import add_verifier_flags, check_cuda, parse_rows, run_stage, stage_parser
from common.config import device, number, resolved
from common.data import load_prepared
from common.layout import DataDir, shard, states_of
from common.extract import RowWriter, TransformersBackend, extract_transformers, plan_batches
from common.rows import row_file, row_files, row_index, row_problem
from common.log import Progress, fmt_bytes, log
from common.manifest import (atomic_write_json, find_stage_dirs, output_lock, prepared_fingerprint, read_manifest,
                             write_manifest)
from common.verifier import (check_aux_layers, check_weights, compute_dtype, default_aux_layers, load_text_config,
                             load_tokenizer, remote_code_needed, resolve_verifier, tokenizer_fingerprint, verifier_fingerprint)

STAGE = "03_extract_hidden_states"


def build_parser():
    p = stage_parser(STAGE, __doc__)
    add_verifier_flags(p)
    p.add_argument("--data-dir", default="data", help="data root holding prepared/rows_*")
    p.add_argument("--rows", help="A-B: extract only prepared/rows_A-B (default: every prepared folder)")
    p.add_argument("--layers", type=int, nargs="+",
                   help="aux layer ids, vLLM convention (id k = input of decoder layer k); default 2 N//2 N-3")
    p.add_argument("--backend", choices=["transformers", "vllm"], default="transformers",
                   help="transformers (default) or vllm (tensor parallel, for models that need it)")
    p.add_argument("--max-tokens-per-batch", type=number(int, 1), default=16384,
                   help="padded tokens per forward pass (rows x longest row); bounds memory")
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda, cpu, or auto (transformers device_map over all visible GPUs)")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                   help="compute dtype (default bfloat16 on a GPU and on a CPU with AMX or AVX512-BF16, float32 on other CPUs); "
                        "files: --hidden-states-dtype")
    p.add_argument("--hidden-states-dtype", choices=["bf16", "fp8"], default="bf16",
                   help="file format of the states: bf16, or fp8 (float8_e4m3fn with one float32 scale per token, "
                        "hs-connectors' format: about half the bytes); 04 reads both")
    p.add_argument("--tensor-parallel-size", type=number(int, 1), default=1, help="vllm backend: GPUs per model")
    p.add_argument("--writer-threads", type=number(int, 1), default=4, help="threads writing files while the model runs")
    p.add_argument("--force", action="store_true", help="start even if the disk looks too small for the output")
    return p


def extract_config(text_config, aux, fp8: bool) -> dict:
    """What the files depend on; a resumed run must match it."""
    return {"verifier_hash": verifier_fingerprint(text_config), "aux_layers": aux,
            "final_layer": text_config.num_hidden_layers, "hidden_size": text_config.hidden_size,
            **({"hidden_states_dtype": "fp8"} if fp8 else {})}  # bf16 folders of earlier versions stay valid


def scan_existing(out, rows, n_slots, hidden_size, fp8) -> tuple[list[int], int]:
    """Indices still to do, and how many files found on disk were corrupt (removed, to be redone)."""
    for stale in glob.glob(os.path.join(out, "*.tmp*")):  # ours (.tmp) and safetensors' own (.tmpXXXX)
        os.remove(stale)
    for path in row_files(out):  # rows beyond a shorter rerun of 01
        if row_index(path) not in rows:
            os.remove(path)
    todo, corrupt = [], 0
    for i, row in rows.items():
        path = row_file(out, i)
        problem = row_problem(path, len(row["input_ids"]), n_slots, hidden_size, fp8, token_ids=row["input_ids"])
        if problem is None:
            continue
        if problem != "missing":
            corrupt += 1
            log.warning(f"{path} is {problem} (corrupt or from another row); redoing it")
            os.remove(path)
        todo.append(i)
    return todo, corrupt


def extract_folder(args, backend, pad_id, prepared, verifier, text_config, aux, tok_hash):
    out = states_of(prepared, DataDir(args.data_dir))
    with output_lock(out):  # one run writes a folder
        return extract_locked(args, backend, pad_id, prepared, out, verifier, text_config, aux, tok_hash)


def extract_locked(args, backend, pad_id, prepared, out, verifier, text_config, aux, tok_hash):
    fp8 = args.hidden_states_dtype == "fp8"
    config = extract_config(text_config, aux, fp8)
    cfg_path = os.path.join(out, "extract_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            old = json.load(f)
        # settings of a run that wrote no states (it failed early) bind nothing
        if old != config and row_files(out):
            raise UserError(f"{out} holds states of another verifier, other layers ({old['aux_layers']}) or another "
                            f"--hidden-states-dtype ({old.get('hidden_states_dtype', 'bf16')}); "
                            "delete it or choose another --data-dir")
    atomic_write_json(cfg_path, config)
    done_path = os.path.join(out, "manifest.json")
    if os.path.exists(done_path) and read_manifest(out, "hidden_states")["inputs"]["prepared_manifest_hash"] != \
            prepared_fingerprint(prepared):
        log.warning(f"{prepared} changed since {out} was extracted (01_prepare_dataset.py was rerun): "
                    "extracting every row again")
        os.remove(done_path)
        for path in row_files(out):
            os.remove(path)
    prepared_hash = prepared_fingerprint(prepared)  # before the rows are read: 01 rewriting them meanwhile is caught
    ds = load_prepared(prepared)
    rows = {i: {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for i, r in enumerate(ds)}
    n_slots, hidden = len(aux) + 1, text_config.hidden_size
    todo, corrupt = scan_existing(out, rows, n_slots, hidden, fp8)
    tokens_todo = sum(len(rows[i]["input_ids"]) for i in todo)
    # bf16 states (or fp8 and a float32 scale) + int64 token id and mask
    bytes_per_token = n_slots * hidden * (1 if fp8 else 2) + (4 if fp8 else 0) + 16
    need = tokens_todo * bytes_per_token
    free = shutil.disk_usage(out).free
    log.info(f"{prepared}: {len(rows) - len(todo)} rows already done, {len(todo)} to do "
             f"({tokens_todo:,} tokens, about {fmt_bytes(need)}; {fmt_bytes(free)} free)")
    if need > free and not args.force:
        raise UserError(f"the output needs about {fmt_bytes(need)} but {out} has {fmt_bytes(free)} free; "
                        "free space, choose another --data-dir, or pass --force")
    start = time.time()
    if todo:
        # the pinned ring serves the transformers path's GPU copies; vLLM's connector hands over host tensors
        ring = args.max_tokens_per_batch * n_slots * hidden if args.backend == "transformers" else 0
        writer = RowWriter(args.writer_threads, capacity=ring, fp8=fp8)
        done_tokens = {"n": 0}
        progress = Progress(len(todo), "rows", extra=lambda: (
            f"{done_tokens['n'] / max(time.time() - start, 1e-9):,.0f} tok/s {writer.bytes / 1e9:.2f} GB written"))
        todo_rows = {i: rows[i] for i in todo}

        def on_done(n_rows):
            progress.update(n_rows)

        if args.backend == "transformers":
            # Batches are planned over all rows, so a resumed run computes each row in the same batch as
            # an uninterrupted one would (identical files); batches already written are skipped.
            planned = plan_batches({i: len(r["input_ids"]) for i, r in rows.items()}, args.max_tokens_per_batch)
            batches = [b for b in planned if any(i in todo_rows for i in b)]
            log.info(f"{len(batches)} batches of at most {args.max_tokens_per_batch} padded tokens")

            def count(n_rows, batch_tokens):
                done_tokens["n"] += batch_tokens
                on_done(n_rows)
            for batch in batches:
                tokens = sum(len(rows[i]["input_ids"]) for i in batch)
                extract_transformers(backend, [batch], rows, set(todo_rows), out, writer, pad_id,
                                     lambda n, t=tokens: count(n, t))
        else:
            from common.vllm_extract import extract_vllm
            extract_vllm(backend, todo_rows, out, writer, args.max_tokens_per_batch,
                         lambda n, t: (done_tokens.__setitem__("n", done_tokens["n"] + t), on_done(n)))
        writer.close()
        progress.close()
    wall = time.time() - start
    if prepared_fingerprint(prepared) != prepared_hash:
        raise UserError(f"{prepared} was rewritten (01_prepare_dataset.py ran) while these states were extracted: "
                        f"they are of the old rows; rerun 03_extract_hidden_states.py once 01 has finished")
    total_bytes = sum(os.path.getsize(row_file(out, i)) for i in rows)
    total_tokens = sum(len(r["input_ids"]) for r in rows.values())
    counts = {"rows": len(rows), "extracted": len(todo), "skipped_complete": len(rows) - len(todo),
              "corrupt_redone": corrupt, "tokens": total_tokens, "tokens_extracted": tokens_todo,
              "tokens_per_s": round(tokens_todo / wall, 1) if todo else None, "bytes": total_bytes,
              "bytes_per_token": round(total_bytes / total_tokens, 1)}
    write_manifest(out, "hidden_states", args, wall_s=wall, counts=counts,
                   inputs={"verifier_path": verifier, "verifier_hash": config["verifier_hash"],
                           "tokenizer_hash": tok_hash, "prepared_dir": os.path.relpath(prepared, out),
                           "prepared_manifest_hash": prepared_hash},
                   aux_layers=aux, final_layer=config["final_layer"], hidden_size=hidden,
                   num_hidden_layers=text_config.num_hidden_layers, backend=args.backend,
                   hidden_states_dtype=args.hidden_states_dtype)
    return counts


def run(args):
    check_cuda(args.device)
    verifier = resolve_verifier(args.verifier_path)
    args = resolved(args, trust_remote_code=remote_code_needed(verifier, args.trust_remote_code))
    tokenizer = load_tokenizer(verifier, args.trust_remote_code)
    tok_hash = tokenizer_fingerprint(tokenizer)
    folders = find_stage_dirs(DataDir(args.data_dir).prepared(shard(*parse_rows(args.rows))) if args.rows
                              else args.data_dir, "prepare")
    for folder in folders:
        if read_manifest(folder, "prepare")["inputs"]["tokenizer_hash"] != tok_hash:
            raise UserError(f"{folder} was tokenized with another tokenizer than {verifier}'s; "
                            "rerun 01_prepare_dataset.py with this --verifier-path")
    text_config = load_text_config(verifier, args.trust_remote_code)
    check_weights(verifier, text_config)
    n = text_config.num_hidden_layers
    aux = check_aux_layers(args.layers if args.layers else default_aux_layers(n), n)
    log.info(f"verifier {verifier}: {n} layers, hidden {text_config.hidden_size}; aux layers {aux} + final layer {n}")
    args = resolved(args, dtype=args.dtype or compute_dtype(args.device))  # the manifest's flags record the one used
    dtype = args.dtype
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if args.backend == "transformers":
        backend = TransformersBackend.load(verifier, aux, n, dtype, args.device, args.trust_remote_code)
    else:
        from common.vllm_extract import VllmBackend
        backend = VllmBackend(verifier, aux, n, args.tensor_parallel_size, dtype, args.trust_remote_code,
                              max_len=max(read_manifest(f, "prepare")["counts"]["max_row_tokens"] for f in folders))
    totals = [extract_folder(args, backend, pad_id, f, verifier, text_config, aux, tok_hash) for f in folders]
    rows = sum(t["rows"] for t in totals)
    done = sum(t["extracted"] for t in totals)
    gb = sum(t["bytes"] for t in totals) / 1e9
    return f"{rows} rows in {len(folders)} folder(s), {done} extracted now, {gb:.2f} GB on disk"


if __name__ == "__main__":
    run_stage(STAGE, build_parser(), run)
