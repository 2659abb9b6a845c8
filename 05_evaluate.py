#!/usr/bin/env python3
"""Stage 05: acceptance length of EAGLE-3 drafts against the verifier, in real vLLM speculative decoding,
per draft position, on held-out prompts -> <output-dir>/eval/{eval.json, eval.md, acceptance.png}."""
import gc
import json
import os

import torch

from common.errors import UserError
from common.cli import add_verifier_flags, check_cuda, run_stage, stage_parser
from common.config import EvalConfig, add_options, device, from_args, number, resolved
from common.cost import draft_read, estimated_speedup, verifier_read
from common.log import log
from common.manifest import output_lock
from common.verifier import (check_weights, compute_dtype, load_text_config, load_tokenizer, remote_code_needed,
                             resolve_verifier)

STAGE = "05_evaluate"


def build_parser():
    p = stage_parser(STAGE, __doc__)
    add_verifier_flags(p)
    p.add_argument("--draft-path", required=True, help="draft checkpoint (for example out/checkpoints/best)")
    p.add_argument("--compare", nargs="+", default=[], help="more draft checkpoints, evaluated on the same prompts")
    p.add_argument("--paired-with", metavar="EVAL_JSON[:DRAFT]",
                   help="a stored 05 report (eval.json) of the same prompts and settings: its first draft (or DRAFT) "
                        "heads the table and every draft here is paired against it, without evaluating it again")
    p.add_argument("--prompts", default="sharegpt",
                   help="'sharegpt' (ShareGPT's fixed held-out split, every 50th conversation, less any a training row "
                        "came from) or a .jsonl/.json of prompts or conversations")
    p.add_argument("--data-dir", default="data", help="data root whose prepared rows are excluded from the prompts")
    p.add_argument("--output-dir", default="out", help="the report goes to <output-dir>/eval")
    p.add_argument("--num-prompts", type=number(int, 1), default=16, help="conversations to answer")
    p.add_argument("--max-turns", type=number(int, 1), default=2, help="user turns per conversation, answered one by one")
    p.add_argument("--backend", choices=["vllm", "transformers"], default="vllm",
                   help="vllm (real speculative decoding) or transformers (simulated greedy chain, no vLLM needed)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="verifier dtype (default: compute_dtype's rule for generated text, common/verifier.py)")
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="transformers backend device: cuda, cpu, or auto (the verifier spread over all GPUs by "
                        "device_map, for one that does not fit a single GPU)")
    add_options(p, EvalConfig)  # decoding and the engine: each flag's default, help and check in common/config.py
    return p


def draft_names(paths: list[str]) -> dict[str, str]:
    """A row name for each draft: the last folder of its real path, or as many of its last folders as it
    takes to tell it from the others (`runA/checkpoints/best` and `runB/checkpoints/best` both point at an
    `epoch_2`: they become `runA/checkpoints/epoch_2` and `runB/...`). The same draft twice is an error."""
    parts = [os.path.realpath(p.rstrip("/")).split(os.sep) for p in paths]
    if len(set(map(tuple, parts))) < len(parts):
        raise UserError(f"the same draft is given twice ({' '.join(paths)}): give each once")
    depth = [1] * len(parts)
    while True:
        names = ["/".join(x[-d:]) for x, d in zip(parts, depth)]
        clashes = [i for i, n in enumerate(names) if names.count(n) > 1]
        if not clashes:
            return dict(zip(names, paths))
        for i in clashes:
            depth[i] += 1


def check_draft(path: str, text_config) -> None:
    """A whole speculators EAGLE-3 checkpoint for this verifier, or one line saying what is wrong with it."""
    from common.rows import whole_safetensors
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise UserError(f"{path}: not a draft checkpoint (no config.json); run 04_train.py first")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except ValueError as e:
        raise UserError(f"{cfg_path} is damaged ({e}); use another checkpoint or copy it again")
    weights = os.path.join(path, "model.safetensors")
    try:
        whole_safetensors(weights)
    except FileNotFoundError:
        raise UserError(f"{path} has no model.safetensors (a copy or a save cut short); use another checkpoint")
    except ValueError as e:
        raise UserError(f"{weights} is {e}; use another checkpoint or copy it again")
    if cfg.get("speculators_model_type") != "eagle3":
        raise UserError(f"{path}: not a speculators EAGLE-3 checkpoint")
    layer = cfg["transformer_layer_config"]
    if layer["hidden_size"] != text_config.hidden_size or layer["vocab_size"] != text_config.vocab_size:
        raise UserError(f"{path} was trained for a verifier with hidden size {layer['hidden_size']} and vocab "
                        f"{layer['vocab_size']}, but --verifier-path has {text_config.hidden_size} and "
                        f"{text_config.vocab_size}")


def run(args):
    if args.backend == "transformers" and args.temperature > 0:
        raise UserError("--backend transformers simulates greedy decoding only; use --temperature 0")
    check_cuda(args.device)
    with output_lock(os.path.join(args.output_dir, "eval")):  # one evaluation writes a report
        return evaluate(args)


def evaluate(args) -> str:
    from common import evaluate as ev
    verifier = resolve_verifier(args.verifier_path)
    # the settings resolved in one visible step: whether the verifier's code runs, the dtype
    device_type = "cpu" if args.device == "cpu" or not torch.cuda.is_available() else "cuda"
    args = resolved(args, trust_remote_code=remote_code_needed(verifier, args.trust_remote_code),
                    dtype=args.dtype or compute_dtype(device_type, generating=True))
    cfg = from_args(EvalConfig, args)
    text_config = load_text_config(verifier, args.trust_remote_code)
    check_weights(verifier, text_config)
    drafts = draft_names([args.draft_path, *args.compare])
    for path in drafts.values():
        check_draft(path, text_config)
    tokenizer = load_tokenizer(verifier, args.trust_remote_code)
    prompts = ev.load_prompts(args.prompts, args.data_dir, args.num_prompts, args.max_turns, args.seed)
    log.info(f"{len(prompts)} conversations, {sum(map(len, prompts))} turns, {args.max_new_tokens} new tokens each; "
             f"backend {args.backend}")
    report = {"backend": args.backend, "verifier": verifier, "num_speculative_tokens": args.num_speculative_tokens,
              "temperature": args.temperature, "num_conversations": len(prompts), "drafts": {},
              "verifier_read_per_token": verifier_read(verifier, text_config),
              "prompts_sha256": ev.prompts_fingerprint(prompts), "max_new_tokens": args.max_new_tokens,
              "max_prompt_len": args.max_prompt_len}
    if args.paired_with:  # checked before any generation; its answers once the baseline's are known
        name, stored = ev.stored_reference(args.paired_with, report)
        report["drafts"][name] = stored

    eos = tokenizer.eos_token_id
    if args.backend == "vllm":
        llm = ev.vllm_engine(verifier, cfg)
        base, base_time, base_tokens = ev.generate_vllm(llm, tokenizer, prompts, cfg)
        del llm
        gc.collect()
    else:
        from common.draft import load_draft
        sim = ev.ChainSimulator(verifier, args.device, getattr(torch, args.dtype), args.trust_remote_code)
        base, base_time, base_tokens = ev.answer_one_by_one(
            lambda ids: sim.plain(ids, args.max_new_tokens, eos), tokenizer, prompts, cfg)
    report["baseline_tokens_per_s"] = base_tokens / base_time
    if args.paired_with:
        ev.check_stored_answers(name, stored, base_tokens)
    for name, path in drafts.items():
        per_conversation = [[0, 0] for _ in prompts]  # verify steps, accepted draft tokens
        if args.backend == "vllm":
            llm = ev.vllm_engine(verifier, cfg, draft=path)
            answers, wall, tokens = ev.generate_vllm(llm, tokenizer, prompts, cfg, per_conversation)
            stats = ev.spec_counters(llm)
            del llm
            gc.collect()
        else:
            sim.set_draft(load_draft(path, args.trust_remote_code))
            stats = ev.new_stats(args.num_speculative_tokens)
            answers, wall, tokens = ev.answer_one_by_one(
                lambda ids: sim.generate(ids, args.max_new_tokens, args.num_speculative_tokens, eos, stats),
                tokenizer, prompts, cfg, stats, per_conversation)
        result = ev.acceptance(stats)
        result.update(tokens_per_s=tokens / wall, generated_tokens=tokens, path=path)
        # what a drafted token costs against a verify step, as memory-bound decoding of a large verifier pays it
        result["draft_read_per_token"] = draft_read(path)
        result["c"] = result["draft_read_per_token"]["bytes"] / report["verifier_read_per_token"]["bytes"]
        result["estimated_speedup"] = estimated_speedup(result["mean_acceptance_length"], result["c"],
                                                        args.num_speculative_tokens)
        counted = [sum(c) for c in zip(*per_conversation)]
        if counted == [stats["drafts"], stats["accepted"]]:
            result["per_conversation"] = per_conversation  # what the 95% intervals are drawn from
        else:  # a vLLM without per-request spec-decode counts gives none
            log.warning(f"{name}: per-conversation counts (verify steps, accepted) {counted} do not add up to the "
                        f"engine's totals {[stats['drafts'], stats['accepted']]}: no 95% intervals")
        if args.temperature == 0:
            mismatched = sum(a != b for conv_a, conv_b in zip(answers, base) for a, b in zip(conv_a, conv_b))
            result["lossless"] = mismatched == 0
            if mismatched:
                log.error(f"LOSSLESS CHECK FAILED for {name}: {mismatched} answers differ from greedy decoding "
                          "without speculation")
        else:
            result["lossless"] = "n/a"
        report["drafts"][name] = result
        log.info(f"{name}: mean acceptance length {result['mean_acceptance_length']:.3f}, per position "
                 f"{[round(x, 3) for x in result['acceptance_rate_per_pos']]}; c {result['c']:.3f}, estimated "
                 f"speedup {result['estimated_speedup']:.2f}x")
    ev.add_intervals(report["drafts"], args.seed)
    table = ev.save_report(ev.json_safe(report), os.path.join(args.output_dir, "eval"))
    for line in table.splitlines():
        log.info(line)
    best = max(report["drafts"].items(), key=lambda kv: kv[1]["mean_acceptance_length"])
    return f"mean acceptance length {best[1]['mean_acceptance_length']:.3f} ({best[0]}); report in {args.output_dir}/eval"


if __name__ == "__main__":
    run_stage(STAGE, build_parser(), run)
