"""Stage 05: acceptance length of drafts against the verifier, on held-out prompts.

Two backends: vLLM speculative decoding (the real thing), and a transformers simulation of greedy
chain speculation (for machines without vLLM) that follows vLLM's EAGLE-3 proposer step by step.
"""
import dataclasses
import hashlib
import json
import os
import random
import time

import numpy as np
import torch

from common.config import EvalConfig
from common.errors import UserError
from common.data import HELD_OUT_EVERY, is_held_out, load_prepared, load_records, normalize
from common.layout import DataDir
from common.log import log
from common.manifest import MANIFEST
from common.verifier import load_verifier_lm, load_vllm


# ---------------------------------------------------------------- prompts

def used_conversations(data_dir: str) -> set:
    """Source conversation ids that stage 01 turned into training rows under data_dir."""
    used = set()
    prepared = DataDir(data_dir).prepared()
    for folder in os.listdir(prepared) if os.path.isdir(prepared) else []:
        if os.path.exists(os.path.join(prepared, folder, MANIFEST)):
            used.update(load_prepared(os.path.join(prepared, folder))["conversation_id"])
    return used


def load_prompts(source: str, data_dir: str, num_prompts: int, max_turns: int, seed: int) -> list[list[str]]:
    """Held-out conversations as lists of user turns. Default: ShareGPT's held-out split, less any
    conversation a training row came from; else a jsonl of {"prompt": str}, plain strings, or conversations."""
    if source == "sharegpt":  # the fixed held-out split, less anything a training row came from
        skip = used_conversations(data_dir)
        records = [(i, r) for i, r in enumerate(load_records("sharegpt")) if is_held_out("sharegpt", i) and i not in skip]
        random.Random(seed + 1).shuffle(records)
        log.info(f"held-out prompts: ShareGPT's held-out split (every {HELD_OUT_EVERY}th conversation, "
                 f"{len(records)} of them), none among the {len(skip)} used for training")
    else:
        if not os.path.exists(source):
            raise UserError(f"--prompts {source}: file not found")
        records = list(enumerate(load_records(source)))
    prompts = []
    for _, record in records:
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            turns = [record["prompt"]]
        elif isinstance(record, str):
            turns = [record]
        else:
            messages = normalize(record)  # ShareGPT/OpenAI shapes, or a bare list of turns
            turns = [] if isinstance(messages, str) else [m["content"] for m in messages if m["role"] == "user"]
        turns = [t for t in turns if t.strip()][:max_turns]
        if turns:
            prompts.append(turns)
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise UserError(f"--prompts {source}: no prompts found (expected {{\"prompt\": ...}} lines or conversations)")
    return prompts


def render(tokenizer, history: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(history, tokenize=True, add_generation_prompt=True, return_dict=False)


def clip_prompt(ids: list[int], max_prompt: int) -> list[int]:
    return ids[-max_prompt:]


# ---------------------------------------------------------------- vLLM

def vllm_engine(verifier: str, cfg: EvalConfig, draft: str | None = None):
    from vllm.engine.arg_utils import EngineArgs
    spec = None if draft is None else {"method": "eagle3", "model": draft,
                                       "num_speculative_tokens": cfg.num_speculative_tokens}
    # text prompts only: a multimodal wrapper (Kimi-K2.5) runs without building its vision tower
    # per-request counts (summary: a histogram of accepted tokens per verify step) give each conversation's figures;
    # a vLLM older than them serves without (and 05 reports no intervals)
    per_request = {"per_request_spec_decode_metrics": "summary"} if draft is not None and (
        "per_request_spec_decode_metrics" in {f.name for f in dataclasses.fields(EngineArgs)}) else {}
    return load_vllm(model=verifier, speculative_config=spec, disable_log_stats=False, enforce_eager=True, **per_request,
                     max_model_len=cfg.max_model_len, dtype=cfg.dtype, seed=cfg.seed,
                     trust_remote_code=cfg.trust_remote_code, enable_prefix_caching=False,
                     tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
                     language_model_only=True)


def spec_counters(llm) -> dict:
    """Drafts, draft tokens, accepted tokens (total and per position) from vLLM's metrics."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [a + b for a, b in zip(out["accepted_per_pos"] or [0] * len(m.values), m.values)]
    return out


def generate_vllm(llm, tokenizer, prompts, cfg: EvalConfig, per_conversation=None) -> tuple[list[list[list[int]]], float, int]:
    """Answer every conversation turn by turn (all conversations batched per turn); returns the
    token ids of each answer, the wall time and the tokens generated. With speculation, adds each
    conversation's verify steps and accepted draft tokens into `per_conversation` ([steps, accepted] each)."""
    from vllm import SamplingParams, TokensPrompt
    params = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    histories = [[] for _ in prompts]
    answers = [[] for _ in prompts]
    start, generated = time.time(), 0
    for turn in range(max(len(p) for p in prompts)):
        active = [i for i, p in enumerate(prompts) if turn < len(p)]
        for i in active:
            histories[i].append({"role": "user", "content": prompts[i][turn]})
        inputs = [TokensPrompt(prompt_token_ids=clip_prompt(render(tokenizer, histories[i]), cfg.max_prompt_len))
                  for i in active]
        for i, out in zip(active, llm.generate(inputs, params, use_tqdm=False)):
            ids = list(out.outputs[0].token_ids)
            generated += len(ids)
            spec = getattr(out.outputs[0], "spec_decode_metrics", None)  # absent in a vLLM without per-request counts
            if per_conversation is not None and spec is not None:
                per_conversation[i][0] += sum(spec.histogram)
                per_conversation[i][1] += sum(j * c for j, c in enumerate(spec.histogram))
            answers[i].append(ids)
            histories[i].append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
    return answers, time.time() - start, generated


# ---------------------------------------------------------------- transformers simulation

class ChainSimulator:
    """Greedy chain speculation with a verifier (transformers) and an EAGLE-3 draft, as vLLM runs it:
    the draft's cache holds its first-step entries for every verified position (computed from the
    verifier's aux states and the next token); each round it proposes k tokens from the last one,
    feeding back its own hidden state, then the verifier accepts the longest matching prefix plus
    one bonus token."""

    def __init__(self, verifier_path: str, device: str, dtype: torch.dtype, trust_remote_code: bool):
        from common.extract import decoder_layers
        self.dtype = dtype
        if device == "auto":  # spread over every visible GPU (device_map), as a verifier too big for one needs
            self.verifier = load_verifier_lm(verifier_path, dtype=dtype, trust_remote_code=trust_remote_code,
                                             device_map="auto").eval()
        else:
            self.verifier = load_verifier_lm(verifier_path, dtype=dtype,
                                             trust_remote_code=trust_remote_code).to(device).eval()
        self.device = self.verifier.get_input_embeddings().weight.device  # inputs, the draft and its states
        self.layers = decoder_layers(self.verifier, self.verifier.config.get_text_config().num_hidden_layers)
        self.draft, self.hooks, self.aux = None, [], []

    def set_draft(self, draft) -> None:
        """Use this draft; hooks capture the verifier layers that it reads."""
        for h in self.hooks:
            h.remove()
        self.draft = draft.to(self.device, self.dtype).eval()
        self.aux = [None] * len(draft.target_layer_ids)
        self.hooks = [self.layers[k].register_forward_pre_hook(self._hook(slot), with_kwargs=True)
                      for slot, k in enumerate(draft.target_layer_ids)]

    def _hook(self, slot):
        def hook(_m, args, kwargs):
            self.aux[slot] = args[0] if args else kwargs["hidden_states"]
        return hook

    @torch.no_grad()
    def plain(self, prompt: list[int], max_new: int, eos: int, stats=None) -> list[int]:
        """Greedy decoding without speculation: the baseline for speed and the lossless check."""
        x = torch.tensor([prompt], device=self.device)
        out = self.verifier.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos)
        return out[0, len(prompt):].tolist()

    def _verify(self, ids: list[int], cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Verifier over new tokens: greedy next tokens [T] and concatenated aux states [T, n*H]."""
        x = torch.tensor([ids], device=self.device)
        logits = self.verifier(input_ids=x, past_key_values=cache, use_cache=True).logits[0]
        return logits.argmax(-1).to(self.device), torch.cat([a.to(self.device) for a in self.aux], dim=-1)[0]

    def _draft_step(self, hidden, tokens, start: int, cache):
        """One draft layer pass over len(tokens) positions starting at `start`; returns (out hidden, draft ids)."""
        d = self.draft
        embeds = d.embed_tokens(torch.tensor([tokens], device=self.device))
        h = torch.cat([embeds, hidden[None]], dim=-1)
        positions = torch.arange(start, start + len(tokens), device=self.device)[None] + 1
        cache_position = torch.arange(start, start + len(tokens), device=self.device)
        pos_emb = d.rotary_emb(h, positions)
        for layer in d.layers:
            h = layer(h, attention_mask=None, position_ids=positions, past_key_values=cache,
                      cache_position=cache_position, position_embeddings=pos_emb)
        normed = d.norm(h)
        draft_ids = d.lm_head(normed)[0].argmax(-1)
        out = normed if d.config.norm_output else h  # Eagle-3.1 feeds the normed state to the next step
        return out[0], draft_ids + d.d2t.to(self.device)[draft_ids]

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new: int, k: int, eos: int, stats: dict) -> list[int]:
        from transformers import DynamicCache
        vcache, dcache = DynamicCache(), DynamicCache()
        seq = list(prompt)
        greedy, aux = self._verify(seq, vcache)
        aux_states = aux                                       # aux of every verified position
        seq.append(int(greedy[-1]))                            # the first token comes from the prefill
        out = [seq[-1]]
        drafted = 0                                            # positions with draft-cache entries
        while len(out) < max_new and out[-1] != eos:
            # first draft step over newly verified positions: state of p + token p+1
            m = len(seq) - 1
            aux_in = aux_states[drafted:m]
            hidden = self.draft.fc(aux_in if self.draft.input_norm is None else self.draft.input_norm(aux_in))
            h, ids = self._draft_step(hidden, seq[drafted + 1: m + 1], drafted, dcache)
            drafted = m
            proposals, last_h = [int(ids[-1])], h[-1:]
            for step in range(1, k):
                last_h, ids = self._draft_step(last_h, [proposals[-1]], m + step - 1, dcache)
                proposals.append(int(ids[-1]))
            crop(dcache, drafted)
            # verify: the last token plus the proposals
            greedy, aux = self._verify([seq[-1]] + proposals, vcache)
            accepted = 0
            while accepted < k and proposals[accepted] == int(greedy[accepted]):
                accepted += 1
            stats["drafts"] += 1
            stats["draft_tokens"] += k
            stats["accepted"] += accepted
            for p in range(accepted):
                stats["accepted_per_pos"][p] += 1
            new = proposals[:accepted] + [int(greedy[accepted])]
            aux_states = torch.cat([aux_states, aux[: accepted + 1]])
            crop(vcache, len(seq) + accepted)
            seq.extend(new)
            out.extend(new)
            if eos in new:
                out = out[: out.index(eos) + 1]
                break
        return out[:max_new]


def crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def answer_one_by_one(generate, tokenizer, prompts, cfg: EvalConfig, stats=None, per_conversation=None) -> tuple[list, float, int]:
    """Answer each conversation turn by turn with generate(prompt_ids) -> answer ids; with the `stats` that
    generate adds to, each conversation's verify steps and accepted draft tokens go into `per_conversation`."""
    answers, start, generated = [], time.time(), 0
    for i, turns in enumerate(prompts):
        before = (stats["drafts"], stats["accepted"]) if stats is not None else None
        history, conv = [], []
        for turn in turns:
            history.append({"role": "user", "content": turn})
            ids = generate(clip_prompt(render(tokenizer, history), cfg.max_prompt_len))
            generated += len(ids)
            conv.append(ids)
            history.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
        answers.append(conv)
        if before is not None and per_conversation is not None:
            per_conversation[i] = [stats["drafts"] - before[0], stats["accepted"] - before[1]]
    return answers, time.time() - start, generated


def new_stats(k: int) -> dict:
    return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * k}


# ---------------------------------------------------------------- report

def acceptance(stats: dict) -> dict:
    drafts = max(stats["drafts"], 1)
    return {"mean_acceptance_length": 1 + stats["accepted"] / drafts,
            "acceptance_rate_per_pos": [a / drafts for a in stats["accepted_per_pos"]],
            "drafts": stats["drafts"], "draft_tokens": stats["draft_tokens"], "accepted_tokens": stats["accepted"]}


BOOTSTRAP = 2000  # resamples of the conversations


def bootstrap_interval(per_conversation: list, other: list | None = None, seed: int = 0) -> list[float]:
    """95% interval of the acceptance length (1 + accepted / verify steps) over conversations drawn with
    replacement, or, with `other` (the same conversations under another draft), of the difference between
    the two: paired, so what the conversations share cancels."""
    counts = np.asarray(per_conversation, dtype=float)
    index = np.random.default_rng(seed).integers(0, len(counts), size=(BOOTSTRAP, len(counts)))

    def length(c):
        return 1 + c[index, 1].sum(1) / np.maximum(c[index, 0].sum(1), 1)
    values = length(counts) - (length(np.asarray(other, dtype=float)) if other is not None else 0)
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]


def add_intervals(drafts: dict, seed: int) -> None:
    """Each draft's 95% interval, and every draft's difference to the first, when per-conversation counts exist."""
    first = next(iter(drafts.values()))
    for r in drafts.values():
        if not r.get("per_conversation") or len(r["per_conversation"]) < 2:
            continue
        r["interval_95"] = bootstrap_interval(r["per_conversation"], seed=seed)
        if r is not first and first.get("per_conversation"):
            r["vs_first"] = {"difference": r["mean_acceptance_length"] - first["mean_acceptance_length"],
                             "interval_95": bootstrap_interval(r["per_conversation"], first["per_conversation"], seed)}


# what a stored report must share with this run for its per-conversation counts to pair with this run's
PAIRING_SETTINGS = ("backend", "temperature", "num_speculative_tokens", "num_conversations", "verifier_read_per_token",
                    "prompts_sha256", "max_new_tokens", "max_prompt_len")


def prompts_fingerprint(prompts: list[list[str]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def stored_reference(spec: str, report: dict) -> tuple[str, dict]:
    """The draft that `--paired-with EVAL_JSON[:NAME]` names in a stored 05 report (its first by default), checked
    to come from the same prompts and decoding as this run, so that its per-conversation counts pair with this
    run's: 05 with greedy decoding answers the same prompts the same way every time."""
    path, name = (spec, "") if os.path.isfile(spec) else spec.rsplit(":", 1) if ":" in spec else (spec, "")
    try:
        with open(path) as f:
            stored = json.load(f)
        drafts = stored["drafts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--paired-with {path}: not a readable 05 report ({type(e).__name__}: {e}); give the "
                        "eval.json a 05 run wrote")
    name = name or next(iter(drafts), "")
    if name not in drafts:
        raise UserError(f"--paired-with {spec}: no draft {name!r} in it (it has {', '.join(drafts) or 'none'})")
    if report["temperature"] != 0:
        raise UserError("--paired-with needs greedy decoding (--temperature 0): sampled answers differ from run to run")
    for key in PAIRING_SETTINGS:  # (reports before 2026-12-06 lack the prompts' hash: check_stored_answers then)
        if key in stored and stored[key] != report[key]:
            raise UserError(f"--paired-with {path} was measured with {key} {stored[key]} (this run: {report[key]}): "
                            "pair only a report of the same prompts and settings")
    r = drafts[name]
    needed = ("generated_tokens", "mean_acceptance_length", "acceptance_rate_per_pos", "drafts", "accepted_tokens")
    if (not isinstance(r, dict) or any(k not in r for k in needed) or r.get("lossless") is not True
            or len(r.get("per_conversation") or []) != report["num_conversations"]):
        raise UserError(f"--paired-with {spec}: its draft lacks the counts of a lossless run to pair with (per conversation, tokens, acceptance)")
    stored_draft = {k: v for k, v in r.items() if k != "vs_first"}  # its difference to its own run's first draft
    return f"{name} (stored)", dict(stored_draft, stored_from=path)


def check_stored_answers(name: str, stored: dict, base_tokens: int) -> None:
    """Greedy and lossless, the stored draft generated what this run's verifier alone did: the same tokens."""
    if stored["generated_tokens"] != base_tokens:
        raise UserError(f"--paired-with {stored['stored_from']}: {name} answered with {stored['generated_tokens']} "
                        f"tokens, this run's verifier with {base_tokens}: not the same prompts, verifier or settings")


def markdown_table(report: dict) -> str:
    k = report["num_speculative_tokens"]
    head = ("| draft | acceptance length | 95% interval | vs the first draft | " + " | ".join(f"pos {p + 1}" for p in range(k))
            + " | weights read per drafted token | c | est. speedup (memory-bound) | drafts | accepted | tok/s spec "
            "| tok/s base | measured speedup here | lossless |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    base = report["baseline_tokens_per_s"]
    for name, r in report["drafts"].items():
        rates = " | ".join(f"{x:.3f}" for x in r["acceptance_rate_per_pos"])
        interval = "{:.3f}-{:.3f}".format(*r["interval_95"]) if "interval_95" in r else "-"
        vs = r.get("vs_first")
        vs = f"{vs['difference']:+.3f} ({vs['interval_95'][0]:+.3f} to {vs['interval_95'][1]:+.3f})" if vs else "-"
        cost = (f"{r['draft_read_per_token']['weights'] / 1e6:.1f}M | {r['c']:.3f} | {r['estimated_speedup']:.2f}x"
                if "c" in r else "- | - | -")
        speed = (f"{r['tokens_per_s']:.1f} | {base:.1f} | {r['tokens_per_s'] / base:.2f}x" if "stored_from" not in r
                 else "- | - | -")  # a stored draft's timing is another run's
        lines.append(f"| {name} | {r['mean_acceptance_length']:.3f} | {interval} | {vs} | {rates} | {cost} | {r['drafts']} | "
                     f"{r['accepted_tokens']} | {speed} | {r['lossless']} |")
    v = report.get("verifier_read_per_token")
    if v:
        lines += ["", f"c: the weights a drafted token reads over the verifier's per token ({v['weights'] / 1e6:.1f}M, "
                      f"{v['bytes'] / 1e6:.1f} MB as served; a MoE's active experts only), by bytes as served. Est. "
                      f"speedup = acceptance length / (1 + {k} c): an estimate for a memory-bound verifier (a large "
                      "one on a GPU), not a timing; the measured speedup here is of this machine."]
    return "\n".join(lines)


def save_report(report: dict, out_dir: str) -> str:
    from common.manifest import atomic_write_json, atomic_write_text
    from common.plot import plot_acceptance
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_json(os.path.join(out_dir, "eval.json"), report)
    table = markdown_table(report)
    atomic_write_text(os.path.join(out_dir, "eval.md"), table + "\n")
    plot_acceptance({n: r["acceptance_rate_per_pos"] for n, r in report["drafts"].items()},
                    os.path.join(out_dir, "acceptance.png"))
    return table


def json_safe(obj):
    return json.loads(json.dumps(obj, default=str))
