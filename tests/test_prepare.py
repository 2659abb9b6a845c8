"""Stage 01 on the real SmolLM2 tokenizer and real ShareGPT conversations."""
import json
import os
from collections import Counter

import pytest

from common.data import load_records, normalize, prepare_rows, tokenize_with_mask
from common.data import load_prepared
from conftest import ROOT, ROWS, SEQ, assert_bad_inputs, assert_user_error, kill_at, read_json, stage, stage_module


def multi_turn_conversation():
    for record in load_records("sharegpt"):
        messages = normalize(record)
        if not isinstance(messages, str) and sum(m["role"] == "assistant" for m in messages) >= 3:
            if sum(len(m["content"]) for m in messages) < 6000:
                return messages
    raise AssertionError("no multi-turn conversation in ShareGPT")


def test_mask_decodes_to_exactly_the_assistant_replies(tokenizer):
    messages = multi_turn_conversation()
    ids, mask = tokenize_with_mask(tokenizer, messages)
    masked = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    expected = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
    assert masked == expected
    # the template's default system prompt and the role headers are never trained on
    unmasked = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert "You are a helpful AI assistant" in unmasked and unmasked.count("<|im_start|>assistant") == sum(
        m["role"] == "assistant" for m in messages)


def test_qwen3_thinking_template_masks_every_reply_and_never_stops_the_stage(tokenizer):
    """Qwen3's template (as vLLM ships it for MiniCPM-V 4.5, which reuses it) renders an empty thinking block
    on the last reply only, so earlier turns render differently as the chat grows. Every reply is still
    trained exactly; a conversation whose reply the template does not render as written is dropped, counted."""
    import copy

    import vllm
    path = os.path.join(os.path.dirname(vllm.__file__), "transformers_utils", "chat_templates",
                        "template_minicpmv45.jinja")
    qwen = copy.copy(tokenizer)
    with open(path) as f:
        qwen.chat_template = f.read()
    messages = [m for m in multi_turn_conversation() if m["role"] != "system"]
    text = qwen.apply_chat_template(messages, tokenize=False)
    assert text.count("<think>") == 1  # on the last reply only
    ids, mask = tokenize_with_mask(qwen, messages)
    masked = qwen.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "".join(m["content"].strip() + "<|im_end|>" for m in messages if m["role"] == "assistant")
    # a template that rewrites replies: that conversation is dropped and counted, the others keep their rows
    shouting = copy.copy(tokenizer)
    shouting.chat_template = tokenizer.chat_template.replace("message['content']", "(message['content'] | upper "
                                                             "if message['role'] == 'assistant' and not loop.last "
                                                             "else message['content'])")
    assert shouting.apply_chat_template(messages, tokenize=False) != tokenizer.apply_chat_template(messages,
                                                                                                   tokenize=False)
    rows, dropped = prepare_rows(shouting, [(0, messages), (1, messages[:2])], 4096)
    assert dropped == {"mask_not_placed": 1} and [r["conversation_id"] for r in rows] == [1]


def test_openai_shape_and_messages_column_give_the_same_rows(tokenizer):
    sharegpt = {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]}
    openai = {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]}
    assert normalize(sharegpt) == normalize(openai) == normalize(openai["messages"])
    assert normalize({"text": "no turns"}) == "unknown_shape"
    # a lone surrogate, as json.loads makes of a "\ud800" escape: no tokenizer or Arrow file takes it
    lone = json.loads('[{"from": "human", "value": "a \\ud800 b"}, {"from": "gpt", "value": "ok"}]')
    assert normalize(lone) == "invalid_unicode"


def test_prepared_rows_and_statistics(prepared_dir):
    manifest = read_json(prepared_dir / "manifest.json")
    ds = load_prepared(str(prepared_dir))
    counts = manifest["counts"]
    assert counts["rows"] == len(ds) and counts["rows"] + sum(counts["dropped"].values()) == ROWS
    assert counts["total_tokens"] == sum(ds["seq_len"])
    assert counts["assistant_tokens"] == sum(sum(m) for m in ds["loss_mask"])
    for row in ds:
        assert len(row["input_ids"]) == len(row["loss_mask"]) == row["seq_len"] <= SEQ
        assert 0 < sum(row["loss_mask"]) < row["seq_len"]
    assert manifest["inputs"]["tokenizer_hash"] and manifest["versions"]["transformers"]


KILL_POINTS_01 = {  # while it imports, once it holds its shard's lock (reading, tokenizing), inside the write
    "importing": lambda prepared: True,
    "tokenizing": lambda prepared: (prepared / f".lock.rows_0-{ROWS}").exists(),
    "writing": lambda prepared: prepared.exists() and any(p.name.startswith(".tmp.") for p in prepared.iterdir()),
}


@pytest.mark.parametrize("point", KILL_POINTS_01)
def test_killed_run_rerun_gives_the_same_output(tmp_path, prepared_dir, point):
    args = ["01_prepare_dataset.py", "--data-dir", tmp_path, "--num-samples", ROWS, "--max-seq-len", SEQ]
    kill_at(args, lambda: KILL_POINTS_01[point](tmp_path / "prepared"))
    out = tmp_path / "prepared" / f"rows_0-{ROWS}"
    assert not (out / "manifest.json").exists()  # nothing that looks complete
    stage(*args)
    assert load_prepared(str(out)).to_dict() == load_prepared(str(prepared_dir)).to_dict()
    assert sorted(os.listdir(tmp_path / "prepared")) == [f"rows_0-{ROWS}"]  # no temporary leftovers


def test_rows_range_selects_a_shard(tmp_path, prepared_dir):
    stage("01_prepare_dataset.py", "--data-dir", tmp_path, "--rows", "10-20", "--max-seq-len", SEQ)
    shard = load_prepared(str(tmp_path / "prepared" / "rows_10-20"))
    full = load_prepared(str(prepared_dir))
    ids = set(shard["conversation_id"])
    assert ids and ids <= set(full["conversation_id"])  # the same shuffle, a sub-range
    assert len(shard) <= 10


def test_bad_input_exits_2_with_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    odd = tmp_path / "odd.jsonl"
    odd.write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(5)))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    fake_parquet = tmp_path / "text.parquet"
    fake_parquet.write_text("this is not parquet\n")
    chat = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    corrupt_middle = tmp_path / "corrupt.json"  # a bad element with good ones after it: not a cut-off tail
    corrupt_middle.write_text("[" + json.dumps(chat) + ', {"conversations": [oops}, ' + json.dumps(chat) + "]")
    bad_line = tmp_path / "bad_line.jsonl"
    bad_line.write_text(json.dumps(chat) + "\n{oops\n" + json.dumps(chat) + "\n")
    cases = [
        (["--dataset", str(tmp_path / "missing.jsonl")], "not found"),
        (["--dataset", str(empty)], "no conversations"),
        (["--dataset", str(odd)], "unknown_shape"),
        (["--rows", "0-99999999"], "only"),
        (["--num-samples", "99999999"], "--num-samples 99999999: the dataset has only"),
        (["--rows", "20-10"], "A < B"),
        (["--max-seq-len", "0"], "--max-seq-len"),
        (["--regenerate", "transformers", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--regenerate", "transformers", "--device", "cuda"], "no CUDA"),
        (["--regenerate", "sglang"], "invalid choice"),
        (["--dataset", str(binary)], "not UTF-8"),
        (["--dataset", str(fake_parquet)], "not a readable parquet"),
        (["--dataset", str(corrupt_middle)], "element 1"),
        (["--dataset", str(bad_line)], "line 2"),
        (["--dataset", str(tmp_path)], "unsupported file type"),
    ]
    assert_bad_inputs("01_prepare_dataset.py", cases, lambda i: ["--data-dir", tmp_path / f"d{i}"])
    assert not list(tmp_path.glob("d*/prepared/*/manifest.json"))


def test_config_file_under_command_line(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("max_seq_len: 100\nprepare:\n  num_samples: 6\n  seed: 3\n")
    stage("01_prepare_dataset.py", "--config", cfg, "--data-dir", tmp_path, "--seed", 4)
    flags = read_json(tmp_path / "prepared" / "rows_0-6" / "manifest.json")["flags"]
    assert (flags["max_seq_len"], flags["num_samples"], flags["seed"]) == (100, 6, 4)
    bad = tmp_path / "bad.yaml"
    bad.write_text("prepare:\n  no_such_flag: 1\n")
    assert_user_error(stage("01_prepare_dataset.py", "--config", bad, check=False), "no_such_flag")


@pytest.mark.parametrize("text,words", [
    ("train:\n  scheduler: exponential\n", ["scheduler", "invalid choice", "exponential"]),
    ("max_seq_length: 100\n", ["max_seq_length", "did you mean 'max_seq_len'"]),
    ("- max_seq_len: 100\n", ["top level is a list"]),
    ("train: 3\n", ["section 'train'"]),
    ("train:\n  epochs: 2.5\n", ["epochs", "invalid int value"]),
    ("train:\n  compile: maybe\n", ["compile", "true or false"]),
    ("train:\n  max_step: 3\n", ["did you mean 'max_steps'"]),
    ("train:\n  lr: [1, 2]\n", ["lr", "one value"]),
    ("train: {epochs: 1\n", ["not valid yaml"]),
])
def test_config_values_are_checked_like_flags(tmp_path, text, words):
    """A YAML value goes through the flag's own type and choices; unknown keys are named with the closest flag."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    assert_user_error(stage("04_train.py", "--config", cfg, "--data-dir", tmp_path, check=False), str(cfg), *words)


def test_cut_off_json_array_keeps_its_complete_records_and_says_so(tmp_path):
    chat = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]}
    cut = tmp_path / "cut.json"
    whole = "[" + ", ".join([json.dumps(chat)] * 5) + "]"
    cut.write_text(whole[:-25])  # inside the fifth element
    proc = stage("01_prepare_dataset.py", "--data-dir", tmp_path / "d", "--dataset", cut)
    assert "cut off inside element 4" in proc.stdout + proc.stderr
    counts = read_json(tmp_path / "d" / "prepared" / "rows_0-4" / "manifest.json")["counts"]
    assert counts["rows"] == 4 and counts["truncated_tail_bytes"] > 0
    assert f"is cut off: its last {counts['truncated_tail_bytes']:,} bytes were not read" in proc.stdout  # the summary


@pytest.mark.parametrize("config", sorted(os.listdir(os.path.join(ROOT, "configs"))))
def test_every_shipped_config_passes_every_stage_check(config):
    """configs/ are what users copy: each key is a flag of the stage that reads it, each value one it accepts."""
    from common.cli import read_config
    for script in ("01_prepare_dataset", "02_build_vocab_mapping", "03_extract_hidden_states", "04_train", "05_evaluate"):
        module = stage_module(script)
        assert read_config(module.build_parser(), module.STAGE, os.path.join(ROOT, "configs", config))


KIMI_STYLE_TEMPLATE = (  # Kimi-K2's role markers; reasoning rendered after the last question only, as Kimi-K2.5 does
    "{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- else -%}{%- set content = m.content -%}{%- set reasoning = m.reasoning_content or '' -%}"
    "{%- if '</think>' in content -%}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last -%}<think>{{ reasoning }}</think>{%- else -%}<think></think>{%- endif -%}"
    "{{ content }}<|im_end|>{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def reasoning_conversations():
    """Three turns each: reasoning as a reasoning_content field, and inline in every reply's content."""
    turns = [("What is 2+2?", "Two and two make four.", "4."), ("And 3+3?", "Three and three make six.", "6."),
             ("And 4+4?", "Four and four make eight.", "8.")]
    field, inline = [], []
    for question, thought, answer in turns:
        field += [{"role": "user", "content": question},
                  {"role": "assistant", "content": answer, "reasoning_content": thought}]
        inline += [{"role": "user", "content": question},
                   {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"}]
    return field, inline


@pytest.mark.parametrize("template", ["qwen3", "kimi", "chatml"])
def test_reasoning_is_trained_or_dropped_on_purpose_and_counted(tokenizer, template):
    """--reasoning train (the default) trains the reasoning where the template renders it: the last reply's under
    Qwen3's and a Kimi-style template (they leave earlier replies' reasoning out of the history, as when the verifier
    serves), every reply's under a template that renders content as it is; --reasoning drop trains none. Either way
    every conversation becomes a row and the changes are counted, none dropped as mask_not_placed."""
    import copy

    import vllm
    verifier_tok = copy.copy(tokenizer)
    if template == "qwen3":
        with open(os.path.join(os.path.dirname(vllm.__file__), "transformers_utils", "chat_templates",
                               "template_minicpmv45.jinja")) as f:
            verifier_tok.chat_template = f.read()
    elif template == "kimi":
        verifier_tok.chat_template = KIMI_STYLE_TEMPLATE
    field, inline = reasoning_conversations()
    records = [(0, {"messages": field}), (1, {"messages": inline})]
    for mode in ("train", "drop"):
        changed = Counter()
        rows, dropped = prepare_rows(verifier_tok, records, 4096, reasoning=mode, changed=changed)
        assert not dropped and len(rows) == 2
        for row in rows:
            trained = verifier_tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"]) if m])
            for answer in ("4.", "6.", "8."):
                assert answer in trained
            kept = [t for t in ("Two and two", "Three and three", "Four and four") if t in trained]
            if mode == "drop":  # nowhere in the row, trained or not (a template's own empty <think> block may be)
                assert not any(t in verifier_tok.decode(row["input_ids"]) for t in ("Two and", "Three and", "Four and"))
            elif template == "chatml":
                assert kept == ["Two and two", "Three and three", "Four and four"]
            else:
                assert kept == ["Four and four"]  # the history holds no reasoning, the last reply does
        assert changed == ({"reasoning_dropped": 2} if mode == "drop" else
                           {} if template == "chatml" else {"reasoning_left_out_by_template": 2})
