"""Regeneration (01 --regenerate): every assistant turn rewritten by the verifier itself, turn by turn.

Each reply is generated from the conversation so far, whose earlier replies are already regenerated;
the user (and system) turns stay. A draft then learns the verifier's own continuations, which are what
it must predict at serving time. Conversations go in parts of --regen-chunk; each finished part is one
jsonl file written atomically under <data-dir>/regenerated/rows_A-B/, so a killed run continues at the
first missing part. Backends: vLLM (what users serve with; tensor parallel) and transformers batched
generation (a GPU without vLLM, or the CPU at small size).
"""
import json
import os
import time
from collections import Counter

import torch

from common.errors import UserError
from common.log import Progress, log
from common.manifest import atomic_write_json, atomic_write_text
from common.config import RegenConfig
from common.data import WRITE_PROMPT
from common.manifest import sha256_json
from common.verifier import compute_dtype, load_verifier_lm, load_vllm

SETTINGS = "settings.json"
LOOP_MIN_TOKENS = 32   # a tail repeating at least this long, with period <= LOOP_MAX_PERIOD, is a loop
LOOP_MAX_PERIOD = 48
LOOP_STOP_TOKENS = 96  # the slots decoder stops a reply whose tail has repeated this long (see stuck_in_loop)
PROMPT_TEMPERATURE = 1.0  # self-written user turns are sampled as Magpie samples them, whatever the replies' setting


def script(messages: list[dict]) -> list[list[dict]]:
    """The non-assistant turns before each assistant reply, one group per reply to generate; a second
    assistant turn in a row has no prompt of its own and goes, as do user turns after the last reply."""
    groups, current = [], []
    for m in messages:
        if m["role"] != "assistant":
            current.append({"role": m["role"], "content": m["content"]})
        elif current:
            groups.append(current)
            current = []
    return groups


def cut_loop(ids: list[int], min_tokens: int = LOOP_MIN_TOKENS) -> list[int] | None:
    """A reply whose tail repeats itself (a greedy loop) cut after two periods of the loop, or None if it
    has no loop: two periods teach the draft that it repeats, without hundreds of copies."""
    for period in range(1, LOOP_MAX_PERIOD + 1):
        i = len(ids) - 1
        while i - period >= 0 and ids[i] == ids[i - period]:
            i -= 1
        if len(ids) - 1 - i >= max(min_tokens, 2 * period):
            return ids[:i + 1 + period]  # the loop's first period starts at i + 1 - period
    return None


def stuck_in_loop(ids: list[int]) -> bool:
    """Whether a reply being generated has repeated itself for LOOP_STOP_TOKENS tokens (checked every 16):
    generating it on to its length limit only for cut_loop to cut it there wasted most of a greedy run's
    tokens (2,465 of 6,539 replies looped to the 512-token limit). Stricter than cut_loop's 32 tokens, so
    a long separator line is not taken for a loop; take_reply then cuts it as it would at the limit."""
    return len(ids) >= LOOP_STOP_TOKENS and len(ids) % 16 == 0 and cut_loop(ids, LOOP_STOP_TOKENS) is not None


def encode(tokenizer, messages: list[dict], generation_prompt: bool = True) -> list[int]:
    """Token ids of a rendered conversation, tokenized as 01 tokenizes its rows."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def user_header(tokenizer) -> list[int]:
    """The chat template rendered up to where a user's words begin (any system turn it adds, then the user header):
    given this alone, an instruct model writes a user's request (Magpie)."""
    marker = "USER-TURN-STARTS-HERE"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in text:
        raise UserError("--dataset self-written: the chat template does not render a user turn's text; use a "
                        "chat (instruct) verifier")
    return tokenizer(text[:text.index(marker)], add_special_tokens=False)["input_ids"]


def write_prompts(generate, tokenizer, part: list, cfg: RegenConfig, counts: Counter) -> list:
    """The user turns of self-written conversations (WRITE_PROMPT), each sampled by the verifier from its user
    header; one cut by --max-new-tokens or empty drops its conversation. Other conversations pass as they are."""
    todo = [k for k, (_, messages) in enumerate(part) if messages == WRITE_PROMPT]
    if not todo:
        return part
    header = user_header(tokenizer)
    seeds = [cfg.seed * 1_000_003 + part[k][0] * 101 + 97 for k in todo]  # apart from the replies' seeds
    written = generate([header] * len(todo), [cfg.max_new_tokens] * len(todo), PROMPT_TEMPERATURE, 1.0, seeds)
    part = list(part)
    for k, (ids, finished) in zip(todo, written):
        text = tokenizer.decode(ids, skip_special_tokens=True).strip()
        counts["written_prompts"] += 1
        counts["written_prompt_tokens"] += len(ids)
        if finished and text:
            # an empty assistant turn marks where the reply goes (script)
            part[k] = (part[k][0], [{"role": "user", "content": text}, {"role": "assistant", "content": ""}])
        else:
            counts["unfinished_prompts"] += 1
            part[k] = (part[k][0], "unfinished_prompt")
    return part


def exact_tokens(tokenizer, prompt: list[int], reply: list[int], conversation: list[dict]) -> int:
    """How many of the reply's generated tokens the conversation's row holds, in place after the prompt."""
    row = encode(tokenizer, conversation, generation_prompt=False)
    if row[:len(prompt)] != prompt:
        return 0
    n = 0
    while n < len(reply) and len(prompt) + n < len(row) and row[len(prompt) + n] == reply[n]:
        n += 1
    return n


def sampler(temperature: float, top_p: float, seed: int, device):
    """logits [rows, vocab] -> the next token of each row: argmax, or sampled with temperature and top-p."""
    if temperature == 0:
        return lambda logits: logits.argmax(-1)
    generator = torch.Generator(device=device).manual_seed(seed)

    def pick(logits):
        probs = torch.softmax(logits / temperature, -1)
        if top_p < 1:  # the smallest set of most likely tokens whose mass reaches top_p
            top, order = probs.sort(-1, descending=True)
            probs = torch.zeros_like(probs).scatter(-1, order, top * (top.cumsum(-1) - top < top_p))
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    return pick


class TransformersGenerator:
    """transformers generation, in one of three batchings: `padded` (generate() on left-padded batches, prompts
    sorted by length and batched by a token budget: quick on the CPU), `continuous` (generate_batch(): a
    paged KV cache that refills finished slots; slower on the CPU, and its Python scheduler held a GPU to a
    fraction of the others, docs/benchmarks.md) or `slots` (common/slot_decode.py: fixed cache slots, refilled in groups; Llama-style
    verifiers; the fast one on a GPU)."""

    def __init__(self, verifier: str, device: str, trust_remote_code: bool, batch_tokens: int, eos: int, pad: int,
                 batching: str = "padded", max_len: int = 0, dtype: torch.dtype | None = None):
        self.device = torch.device(device)
        dtype = dtype or getattr(torch, compute_dtype(self.device.type, generating=True))
        self.model = load_verifier_lm(verifier, dtype=dtype, trust_remote_code=trust_remote_code)
        self.model.to(self.device).eval()
        from common.slot_decode import check_supported, supported
        if batching == "auto":  # slots on a GPU where the verifier's attention allows them
            batching = "slots" if self.device.type == "cuda" and supported(self.model) else "padded"
        elif batching == "slots":
            check_supported(self.model)
        self.batch_tokens, self.eos, self.pad, self.batching, self.max_len = batch_tokens, eos, pad, batching, max_len

    def __call__(self, prompts, max_new, temperature, top_p, seeds):
        run = {"continuous": self.continuous, "slots": self.slots}.get(self.batching, self.padded)
        return run(prompts, max_new, temperature, top_p, seeds)

    @property
    def streams(self) -> bool:  # takes follow-up prompts while it runs (see stream)
        return self.batching == "slots"

    def slots(self, prompts, max_new, temperature, top_p, seeds):
        return self.stream(prompts, max_new, temperature, top_p, seeds[0])

    def stream(self, prompts, max_new, temperature, top_p, seed, follow=None, first=None):
        """Replies to `prompts`; `follow(i, reply, finished)` may return a next (prompt, max_new), which is
        appended to `prompts`/`max_new` and generated in the same run (a conversation's next turn); `first`:
        the order to start them in (SlotDecoder.generate). Sets `occupancy`: decode steps and the share of
        slots that held a live reply in them."""
        from common.slot_decode import SlotDecoder
        # a cache of --regen-batch-tokens tokens in rows of --max-seq-len, no more rows than prompts
        rows = max(1, min(len(prompts), self.batch_tokens // self.max_len))
        decoder = SlotDecoder(self.model, rows, self.max_len, prefill_tokens=min(self.batch_tokens, 1 << 15))
        out = decoder.generate(prompts, max_new, sampler(temperature, top_p, seed, self.device), self.eos, follow,
                               stop=stuck_in_loop, first=first)
        self.occupancy = (decoder.steps, decoder.busy / max(1, decoder.steps * rows))
        return out

    @torch.no_grad()
    def continuous(self, prompts, max_new, temperature, top_p, seeds):
        from transformers import ContinuousBatchingConfig, GenerationConfig
        # one generation config for all: every request gets the largest room, each reply is cut to its own
        config = GenerationConfig(max_new_tokens=max(max_new), do_sample=temperature > 0, eos_token_id=self.eos,
                                  pad_token_id=self.pad, temperature=temperature or None,
                                  top_p=top_p if temperature > 0 else None, top_k=None)
        # a KV cache of --regen-batch-tokens tokens (on the CPU at most what the first call can fill, and 16K
        # tokens); the manager (and its CUDA graphs) is kept for the later rounds rather than rebuilt each time
        pages = -(-self.batch_tokens // 256)
        if self.device.type == "cpu":
            pages = min(pages, max(64, sum(-(-(len(p) + max(max_new)) // 256) for p in prompts)))
        outs = self.model.generate_batch(
            inputs=prompts, generation_config=config, persistent_manager=True,
            continuous_batching_config=ContinuousBatchingConfig(
                seed=seeds[0] if temperature > 0 else None, num_blocks=pages))  # of the default 256 tokens
        if len(outs) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(outs)} of {len(prompts)} replies")
        results = []
        for out, room in zip(outs.values(), max_new):  # in the order of the inputs
            reply = list(out.generated_tokens)[:room]
            finished = self.eos in reply
            results.append((reply[:reply.index(self.eos)] if finished else reply, finished))
        return results

    @torch.no_grad()
    def padded(self, prompts, max_new, temperature, top_p, seeds):
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results = [None] * len(prompts)
        while order:
            width = len(prompts[order[0]]) + max(max_new)  # the longest prompt left, and room for any reply
            take = max(1, min(len(order), self.batch_tokens // width))
            batch, order = order[:take], order[take:]
            longest, new = max(len(prompts[i]) for i in batch), max(max_new[i] for i in batch)
            ids = torch.full((len(batch), longest), self.pad, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for row, i in enumerate(batch):
                ids[row, longest - len(prompts[i]):] = torch.tensor(prompts[i])
                attn[row, longest - len(prompts[i]):] = 1
            if temperature > 0:
                torch.manual_seed(seeds[batch[0]])
            out = self.model.generate(
                ids.to(self.device), attention_mask=attn.to(self.device), max_new_tokens=new,
                do_sample=temperature > 0, temperature=temperature or None, top_p=top_p if temperature > 0 else None,
                top_k=None, eos_token_id=self.eos, pad_token_id=self.pad)[:, longest:].tolist()
            for row, i in enumerate(batch):
                reply = out[row][:max_new[i]]
                finished = self.eos in reply
                results[i] = (reply[:reply.index(self.eos)] if finished else reply, finished)
        return results


class VllmGenerator:
    def __init__(self, verifier: str, tensor_parallel_size: int, max_model_len: int, trust_remote_code: bool,
                 eos: int):
        on_cpu = not torch.cuda.is_available()
        self.llm = load_vllm(model=verifier, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                             trust_remote_code=trust_remote_code, enforce_eager=on_cpu,
                             dtype=compute_dtype("cpu" if on_cpu else "cuda", generating=True),
                             enable_prefix_caching=True)
        self.eos = eos

    def __call__(self, prompts, max_new, temperature, top_p, seeds):
        from vllm import SamplingParams, TokensPrompt
        params = [SamplingParams(max_tokens=m, temperature=temperature, top_p=top_p, seed=s)
                  for m, s in zip(max_new, seeds)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        results = []
        for out in outs:
            ids, finished = list(out.outputs[0].token_ids), out.outputs[0].finish_reason == "stop"
            results.append((ids[:-1] if ids and ids[-1] == self.eos else ids, finished))
        return results


def next_prompt(s: dict, tokenizer, cfg: RegenConfig, counts: Counter):
    """The conversation's next reply to generate: (prompt ids, room for the reply), or None when it is done."""
    if not s.get("open") or s["turn"] >= len(s["groups"]):
        return None
    history = s["history"] + s["groups"][s["turn"]]
    ids = encode(tokenizer, history)
    room = min(cfg.max_new_tokens, cfg.max_seq_len - len(ids))
    if room < 1:  # no room left for a reply within --max-seq-len: the row ends here
        s["open"] = False
        counts["stopped_at_max_seq_len"] += 1
        return None
    s["pending"] = history
    return ids, room


def take_reply(s: dict, prompt: list[int], reply: list[int], finished: bool, tokenizer, counts: Counter) -> None:
    """Append a generated reply to the conversation (a loop cut, an empty reply ending it)."""
    s["turn"] += 1
    counts["replies"] += 1
    counts["generated_tokens"] += len(reply) + finished
    message = {"role": "assistant"}
    if not finished:  # cut by the length limit: its end-of-turn token is the template's, left untrained
        counts["hit_length_limit"] += 1
        cut = cut_loop(reply)
        if cut is not None:
            counts["looping"] += 1
            reply = cut
    message["content"] = tokenizer.decode(reply, skip_special_tokens=True)
    if not message["content"].strip():
        counts["empty_reply"] += 1
        s["open"] = False
        return
    # The row is the whole conversation tokenized from its text (01's chat-template path): a reply
    # that does not survive decode + encode (the verifier may emit a non-canonical split) is
    # trained only up to where the row still holds the generated tokens.
    s["history"] = s.pop("pending") + [message]
    exact = exact_tokens(tokenizer, prompt, reply, s["history"])
    if exact < len(reply):
        counts["retokenized_replies"] += 1
        prefix = tokenizer.decode(reply[:exact], skip_special_tokens=True)
        message["trained_chars"] = len(prefix) if message["content"].startswith(prefix) else 0
    elif not finished:
        message["trained_chars"] = len(message["content"])


def regenerate_part(generate, tokenizer, part: list, cfg: RegenConfig, counts: Counter) -> list[dict]:
    # `counts` gathers this part's replies, tokens and cuts; they are saved with it
    """Regenerate one part. A generator that streams (slots) takes a conversation's next turn as soon as
    its reply ends; the others go in rounds over reply positions, every conversation batched per round."""
    states = []
    for conv_id, messages in part:
        if isinstance(messages, str):
            states.append({"id": conv_id, "dropped": messages})
        else:
            states.append({"id": conv_id, "groups": script(messages), "history": [], "open": True, "turn": 0})
    t0 = time.time()

    def next_prompts():  # the next reply of every conversation still open: (owners, prompts, rooms)
        owners, prompts, max_new = [], [], []
        for s in states:
            if "dropped" not in s and (nxt := next_prompt(s, tokenizer, cfg, counts)) is not None:
                owners.append(s)
                prompts.append(nxt[0])
                max_new.append(nxt[1])
        return owners, prompts, max_new

    if getattr(generate, "streams", False):
        owners, prompts, max_new = next_prompts()

        shown = [t0]

        def follow(i: int, reply: list[int], finished: bool):
            s = owners[i]
            take_reply(s, prompts[i], reply, finished, tokenizer, counts)
            nxt = next_prompt(s, tokenizer, cfg, counts)
            if nxt is not None:
                owners.append(s)
            if time.time() - shown[0] >= 30:  # progress within a part: replies, tokens and rate so far
                shown[0] = time.time()
                log.info(f"  {counts['replies']:,} replies ({len(prompts) - counts['replies']:,} known still to "
                         f"come), {counts['generated_tokens']:,} tokens, "
                         f"{counts['generated_tokens'] / (shown[0] - t0):,.0f} generated tok/s")
            return nxt
        # the conversations with the most replies to come start first (their turns follow one another)
        first = sorted(range(len(prompts)), key=lambda i: (-len(owners[i]["groups"]), len(prompts[i])))
        generate.stream(prompts, max_new, cfg.temperature, cfg.top_p, cfg.seed, follow, first)
        steps, occupancy = generate.occupancy
        log.info(f"  {len(prompts)} replies, {counts['generated_tokens'] / max(time.time() - t0, 1e-9):,.0f} "
                 f"generated tok/s; {steps:,} decode steps, slots {occupancy:.0%} busy")
        turns = 0  # no rounds left
    else:
        turns = max((len(s.get("groups", [])) for s in states), default=0)
    for turn in range(turns):
        active, prompts, max_new = next_prompts()
        if not active:
            break
        seeds = [cfg.seed * 1_000_003 + s["id"] * 101 + turn for s in active]
        t0, before = time.time(), counts["generated_tokens"]
        replies = generate(prompts, max_new, cfg.temperature, cfg.top_p, seeds)
        for s, prompt, (reply, finished) in zip(active, prompts, replies):
            take_reply(s, prompt, reply, finished, tokenizer, counts)
        log.info(f"  reply {turn + 1}: {len(active)} conversations, "
                 f"{(counts['generated_tokens'] - before) / max(time.time() - t0, 1e-9):,.0f} generated tok/s")
    out = []
    for s in states:
        if "dropped" in s:
            out.append({"id": s["id"], "dropped": s["dropped"]})
        elif any(m["role"] == "assistant" for m in s["history"]):
            out.append({"id": s["id"], "messages": s["history"]})
        else:
            out.append({"id": s["id"], "dropped": "no_regenerated_reply"})
    return out


def regenerate(records: list, tokenizer, verifier: str, verifier_hash: str, folder: str,
               cfg: RegenConfig) -> tuple[list, dict]:
    """(conversation id, normalized messages or a drop reason) in; the same with regenerated replies out,
    and the counts. Finished parts under `folder` are reused."""
    settings = {"verifier_hash": verifier_hash, "temperature": cfg.temperature, "top_p": cfg.top_p,
                "max_new_tokens": cfg.max_new_tokens, "max_seq_len": cfg.max_seq_len, "seed": cfg.seed,
                "regen_chunk": cfg.regen_chunk, "conversations": [i for i, _ in records],
                "records_hash": sha256_json([m for _, m in records])}  # another --dataset under the same ids
    os.makedirs(folder, exist_ok=True)
    settings_path = os.path.join(folder, SETTINGS)
    if os.path.exists(settings_path):
        with open(settings_path) as f:
            same = json.load(f) == settings
        if not same:
            raise UserError(f"{folder} holds replies regenerated with another verifier, --dataset, conversations, "
                            "--temperature, "
                            "--top-p, --max-new-tokens, --max-seq-len, --seed or --regen-chunk; delete it to regenerate")
    else:
        atomic_write_json(settings_path, settings)
    parts = [records[i:i + cfg.regen_chunk] for i in range(0, len(records), cfg.regen_chunk)]
    paths = [os.path.join(folder, f"part_{k:05d}.jsonl") for k in range(len(parts))]
    todo = [k for k, path in enumerate(paths) if not os.path.exists(path)]
    generate = None
    if len(todo) < len(parts):
        log.info(f"regeneration: {len(parts) - len(todo)} of {len(parts)} parts already done in {folder}")
    if todo:
        eos = tokenizer.eos_token_id
        if cfg.regenerate == "vllm":
            generate = VllmGenerator(verifier, cfg.tensor_parallel_size, cfg.max_seq_len + 8,
                                     cfg.trust_remote_code, eos)
        else:
            generate = TransformersGenerator(verifier, cfg.device, cfg.trust_remote_code, cfg.regen_batch_tokens,
                                             eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
                                             cfg.regen_batching, cfg.max_seq_len)
            log.info(f"regeneration: transformers on {cfg.device}, {generate.batching} batching")
    start, now = time.time(), Counter()  # `now`: what this run generated, for its rate
    progress = Progress(sum(len(parts[k]) for k in todo), "conversations", desc="regenerated",
                        extra=lambda: f"{now['generated_tokens'] / max(time.time() - start, 1e-9):,.0f} generated tok/s")
    for k in todo:
        part_start, part_counts = time.time(), Counter()
        rows = regenerate_part(generate, tokenizer, write_prompts(generate, tokenizer, parts[k], cfg, part_counts),
                               cfg, part_counts)
        part_counts["seconds"] = round(time.time() - part_start, 1)
        now.update(part_counts)
        # the part's counts ride as its last line, so a resumed run's manifest still counts every part
        atomic_write_text(paths[k], "".join(json.dumps(r) + "\n" for r in rows + [{"counts": part_counts}]))
        progress.update(len(parts[k]))
    progress.close()
    out, counts = [], Counter()
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if "counts" in r:
                    counts.update(r["counts"])
                else:
                    out.append((r["id"], r.get("messages", r.get("dropped"))))
    counts = dict(counts, seconds=round(counts["seconds"], 1))
    if todo:
        log.info(f"regenerated {counts.get('replies', 0):,} replies, {counts.get('generated_tokens', 0):,} tokens in "
                 f"{counts['seconds']:.0f}s; hit the length limit {counts.get('hit_length_limit', 0)} "
                 f"(looping {counts.get('looping', 0)}), empty {counts.get('empty_reply', 0)}"
                 + (f"; wrote {counts['written_prompts']:,} user turns ({counts.get('unfinished_prompts', 0)} cut "
                    "or empty, dropped)" if "written_prompts" in counts else ""))
    return out, counts
