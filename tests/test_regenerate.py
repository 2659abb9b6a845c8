"""01 --regenerate on the real verifier: every reply rewritten by the verifier, turn by turn; the rows'
trained tokens are exactly its greedy continuation of the conversation so far."""
import json
import os
import shutil
import time

import pytest
import torch

from common.data import HELD_OUT_EVERY, load_prepared, load_records, normalize, prepare_rows
from common.states_server import runs_of_ones
from conftest import assert_user_error, kill, read_json, stage, start_stage

# short questions get short answers, so replies end by themselves and later turns are regenerated too
QUESTIONS = [["What is 2+2? Answer with a number only.", "And 3+3?", "Thanks! Now say goodbye in one word."],
             ["Name one colour. One word only.", "Name another one.", "Which of the two is darker?"],
             ["Write a long essay about the history of Rome.", "Shorter please."]]
REGEN = ["--max-seq-len", 320, "--max-new-tokens", 40, "--regen-chunk", 1, "--no-shuffle"]


def assert_greedy(verifier, folder) -> int:
    """Every trained span of every row is what the verifier generates greedily from the row's prefix."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    spans = 0
    for row in load_prepared(str(folder)):
        ids = row["input_ids"]
        for start, end in runs_of_ones(row["loss_mask"]):
            prefix = torch.tensor([ids[:start]])
            out = model.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=end - start,
                                 do_sample=False, eos_token_id=2, pad_token_id=2)[0, start:].tolist()
            assert out == ids[start:end], (row["conversation_id"], start)
            spans += 1
    return spans


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps({"conversations": [t for q in qs for t in (
        {"from": "human", "value": q}, {"from": "gpt", "value": "an original reply the verifier would not write"})]})
        + "\n" for qs in QUESTIONS))
    return path


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory, chats, verifier):
    data = tmp_path_factory.mktemp("regen")
    stage("01_prepare_dataset.py", "--data-dir", data, "--dataset", chats, "--regenerate", "transformers", *REGEN)
    return data


def test_rows_hold_the_verifiers_greedy_replies_turn_by_turn(regenerated, verifier):
    folder = regenerated / "prepared" / f"rows_0-{len(QUESTIONS)}"
    rows = load_prepared(str(folder))
    assert assert_greedy(verifier, folder) >= 4
    assert max(len(runs_of_ones(r["loss_mask"])) for r in rows) >= 2  # later turns were regenerated too
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(verifier)
    assert all("would not write" not in tok.decode(r["input_ids"]) for r in rows)
    counts = read_json(folder / "manifest.json")["counts"]["regeneration"]
    assert counts["replies"] >= 4 and counts["hit_length_limit"] >= 1  # the essay is cut at 40 tokens
    # a reply cut by the limit is trained without the end-of-turn token the template puts after it,
    # and the conversation goes on (the essay's second turn is regenerated too)
    cut = [(r, end) for r in rows for _, end in runs_of_ones(r["loss_mask"]) if r["input_ids"][end - 1] != 2]
    assert cut and all(r["input_ids"][end] == 2 and not r["loss_mask"][end] for r, end in cut)
    assert any(end < max(e for _, e in runs_of_ones(r["loss_mask"])) for r, end in cut)


def test_killed_regeneration_resumes_without_redoing_parts(tmp_path, chats, regenerated):
    args = ["01_prepare_dataset.py", "--data-dir", tmp_path, "--dataset", chats, "--regenerate", "transformers", *REGEN]
    parts = tmp_path / "regenerated" / f"rows_0-{len(QUESTIONS)}"
    proc = start_stage(*args, quiet=True)
    while proc.poll() is None and not (parts / "part_00000.jsonl").exists():
        time.sleep(0.1)
    kill(proc)
    proc.wait()
    assert not (tmp_path / "prepared" / f"rows_0-{len(QUESTIONS)}" / "manifest.json").exists()
    done = sorted(p.name for p in parts.glob("part_*.jsonl"))
    assert done and len(done) < len(QUESTIONS)
    stamps = {name: os.stat(parts / name).st_mtime_ns for name in done}
    log = stage(*args).stdout
    assert f"{len(done)} of {len(QUESTIONS)} parts already done" in log
    assert all(os.stat(parts / name).st_mtime_ns == stamps[name] for name in done)
    rerun = load_prepared(str(tmp_path / "prepared" / f"rows_0-{len(QUESTIONS)}")).to_dict()
    assert rerun == load_prepared(str(regenerated / "prepared" / f"rows_0-{len(QUESTIONS)}")).to_dict()
    # the manifest counts the parts made before the kill too
    counts = [{k: v for k, v in read_json(d / "prepared" / f"rows_0-{len(QUESTIONS)}" / "manifest.json")["counts"][
        "regeneration"].items() if k != "seconds"} for d in (tmp_path, regenerated)]
    assert counts[0] == counts[1]
    # other settings on the same parts are refused rather than mixed
    assert_user_error(stage(*args, "--temperature", 0.7, check=False), "delete it")


def test_continuous_batching_gives_the_same_rows(tmp_path, chats, regenerated):
    """generate_batch (the GPU path: paged cache, slots refilled as replies end) writes the padded path's rows."""
    log = stage("01_prepare_dataset.py", "--data-dir", tmp_path, "--dataset", chats, "--regenerate", "transformers",
                "--regen-batching", "continuous", *REGEN).stdout
    assert "continuous batching" in log
    folder = f"prepared/rows_0-{len(QUESTIONS)}"
    assert load_prepared(str(tmp_path / folder)).to_dict() == load_prepared(str(regenerated / folder)).to_dict()


def test_slot_batching_gives_the_same_rows(tmp_path, chats, regenerated):
    """common/slot_decode.py (the GPU path: fixed cache slots, its own decode step, refilled as replies end,
    here 2 slots for 3 conversations so a slot is refilled) writes the padded path's rows."""
    log = stage("01_prepare_dataset.py", "--data-dir", tmp_path, "--dataset", chats, "--regenerate", "transformers",
                "--regen-batching", "slots", "--regen-batch-tokens", 640, *REGEN, "--regen-chunk", 3).stdout
    assert "slots batching" in log
    folder = f"prepared/rows_0-{len(QUESTIONS)}"
    assert load_prepared(str(tmp_path / folder)).to_dict() == load_prepared(str(regenerated / folder)).to_dict()


@pytest.mark.slow
def test_vllm_backend_gives_the_verifiers_greedy_replies(tmp_path, chats, verifier):
    stage("01_prepare_dataset.py", "--data-dir", tmp_path, "--dataset", chats, "--regenerate", "vllm", *REGEN)
    assert assert_greedy(verifier, tmp_path / "prepared" / f"rows_0-{len(QUESTIONS)}") >= 4


def test_self_written_conversations_are_the_verifiers_own_prompts_and_replies(tmp_path, regenerated, verifier, tokenizer):
    """--dataset self-written (Magpie): the verifier writes each user turn from its chat template's user header
    alone, sampled, then answers it greedily; the loss mask covers the reply alone; a rerun reuses the parts;
    the replies of another --dataset under the same conversation ids are refused, not reused."""
    from common.regenerate import user_header
    args = ["--data-dir", tmp_path / "self", "--dataset", "self-written", "--num-samples", 8, "--regenerate",
            "transformers", "--max-new-tokens", 96, "--max-seq-len", 384, "--regen-chunk", 4]
    stage("01_prepare_dataset.py", *args)
    folder = tmp_path / "self" / "prepared" / "rows_0-8"
    counts = read_json(folder / "manifest.json")["counts"]
    assert counts["regeneration"]["written_prompts"] == 8
    assert counts["rows"] >= 2 and counts["rows"] + counts["dropped"].get("unfinished_prompt", 0) == 8, counts
    header, prompts = user_header(tokenizer), set()
    for row in load_prepared(str(folder)):
        ids = row["input_ids"]
        (start, _), = runs_of_ones(row["loss_mask"])  # one reply, after the written user turn
        assert ids[:len(header)] == header and start > len(header) + 1
        prompts.add(tuple(ids[len(header):start]))
    assert len(prompts) == counts["rows"]  # sampled: no two alike
    assert assert_greedy(verifier, folder) == counts["rows"]
    assert "2 of 2 parts already done" in stage("01_prepare_dataset.py", *args).stdout
    # the same conversation ids (0-3, unshuffled) and settings as the `regenerated` rows of chats.jsonl
    copy = tmp_path / "copy"
    shutil.copytree(regenerated, copy)
    assert_user_error(stage("01_prepare_dataset.py", "--data-dir", copy, "--dataset", "self-written", "--num-samples",
                            len(QUESTIONS), "--regenerate", "transformers", *REGEN, check=False), "--dataset", "delete it")
    assert_user_error(stage("01_prepare_dataset.py", *args[:6], *args[8:], check=False), "--regenerate")
    assert_user_error(stage("01_prepare_dataset.py", *args[:4], *args[6:], check=False), "--num-samples")


def test_conversations_that_start_with_the_assistant_keep_their_rows(tokenizer):
    fragments = [(i, r) for i, r in enumerate(load_records("sharegpt")[:400])
                 if r["conversations"] and r["conversations"][0]["from"] in ("gpt", "chatgpt")][:5]
    assert fragments
    for _, record in fragments:
        messages = normalize(record)
        assert not isinstance(messages, str)
        assert next(m["role"] for m in messages if m["role"] != "system") == "user"
    rows, dropped = prepare_rows(tokenizer, fragments, 256)
    assert "starts_with_assistant" not in dropped and len(rows) + sum(dropped.values()) == len(fragments)
    assert rows


def test_held_out_split_is_never_prepared(prepared_dir):
    ids = load_prepared(str(prepared_dir))["conversation_id"]
    assert all(i % HELD_OUT_EVERY for i in ids)
    dropped = read_json(prepared_dir / "manifest.json")["counts"]["dropped"]
    assert dropped.get("held_out", 0) >= 1  # 64 shuffled conversations of 17,671 hold one of the 354
