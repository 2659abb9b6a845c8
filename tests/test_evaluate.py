"""Stage 05 with real vLLM (the CPU build) and the real verifier: trained vs random draft, both backends."""

import json
import os
import shutil

import pytest

from conftest import assert_bad_inputs, assert_user_error, read_json, stage, stage_module

EVAL_ARGS = ["--num-prompts", 6, "--max-new-tokens", 48, "--max-turns", 2, "--max-prompt-len", 512]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, verifier, data_dir):
    """An untrained draft of the right shape (its embedding and lm_head are the verifier's), with two
    decoder layers and a wider MLP than the verifier's: vLLM must load and run what `04 --draft-layers 2
    --draft-intermediate-size 2048` writes."""
    from common.draft import build_draft, save_servable
    folder = tmp_path_factory.mktemp("drafts") / "random_draft"
    save_servable(build_draft(verifier, [2, 15, 27], str(data_dir / "vocab_mapping"), 3, "sdpa", num_layers=2,
                              intermediate_size=2048), str(folder))
    return folder


def evaluate(out, backend, trained, random_draft, data_dir):
    stage("05_evaluate.py", "--backend", backend, "--draft-path", trained / "checkpoints" / "best",
          "--compare", random_draft, "--data-dir", data_dir, "--output-dir", out, *EVAL_ARGS)
    return read_json(out / "eval" / "eval.json")


@pytest.fixture(scope="module")
def vllm_report(tmp_path_factory, trained, random_draft, data_dir):
    out = tmp_path_factory.mktemp("eval_vllm")
    report = evaluate(out, "vllm", trained, random_draft, data_dir)
    assert (out / "eval" / "eval.md").exists() and (out / "eval" / "acceptance.png").stat().st_size > 5000
    return report


@pytest.mark.slow
def test_trained_draft_beats_random_and_decoding_is_lossless(vllm_report):
    drafts = vllm_report["drafts"]
    random = drafts["random_draft"]
    trained = next(r for name, r in drafts.items() if name != "random_draft")
    assert abs(random["mean_acceptance_length"] - 1.0) <= 0.02
    assert trained["mean_acceptance_length"] > random["mean_acceptance_length"] + 0.03
    for r in drafts.values():
        assert r["lossless"] is True
        assert len(r["acceptance_rate_per_pos"]) == 3 and r["drafts"] > 0
        rates = r["acceptance_rate_per_pos"]
        assert all(a >= b for a, b in zip(rates, rates[1:]))  # a later position is accepted only after earlier ones
        assert r["mean_acceptance_length"] == pytest.approx(1 + sum(rates))
        # vLLM's per-request counts, one pair per conversation, add up to its engine totals
        assert len(r["per_conversation"]) == vllm_report["num_conversations"]
        assert [sum(c) for c in zip(*r["per_conversation"])] == [r["drafts"], r["accepted_tokens"]]
        low, high = r["interval_95"]
        assert low <= r["mean_acceptance_length"] <= high
    # the random draft is listed after the trained one: the paired interval of its difference lies below zero
    low, high = random["vs_first"]["interval_95"]
    assert low <= random["vs_first"]["difference"] <= high < 0
    assert vllm_report["baseline_tokens_per_s"] > 0
    # the speed side: the two-layer, wider random draft reads more weights per token than the standard one
    # (tests/test_cost.py checks the counts by hand), and the estimate follows tau / (1 + k c)
    assert 0 < trained["c"] < random["c"] < 1
    for r in drafts.values():
        assert r["estimated_speedup"] == pytest.approx(r["mean_acceptance_length"] / (1 + 3 * r["c"]))


def first_conversations_length(report: dict, name: str, n: int) -> float:
    """A draft's acceptance length over the report's first n conversations (from its per-conversation counts)."""
    counts = report["drafts"][name]["per_conversation"][:n]
    return 1 + sum(a for _, a in counts) / sum(d for d, _ in counts)


@pytest.mark.slow
def test_transformers_backend_agrees_with_vllm_and_pairs_with_its_stored_report(tmp_path, vllm_report, trained,
                                                                                random_draft, data_dir):
    """Each draft in its own transformers run, on the first 2 of vllm_report's 6 conversations (the same prompts:
    05 shuffles the held-out split, then takes the first N); the second run pairs with the first's stored report."""
    from common.evaluate import bootstrap_interval
    args = [*EVAL_ARGS, "--num-prompts", 2]  # (argparse: the last --num-prompts wins)
    stage("05_evaluate.py", "--backend", "transformers", "--draft-path", trained / "checkpoints" / "best",
          "--data-dir", data_dir, "--output-dir", tmp_path / "one", *args)
    one = read_json(tmp_path / "one" / "eval" / "eval.json")
    (trained_name, first), = one["drafts"].items()
    # the random draft alone, paired with the trained one as the first run stored it, without evaluating it again
    stage("05_evaluate.py", "--backend", "transformers", "--draft-path", random_draft, "--data-dir", data_dir,
          "--paired-with", tmp_path / "one" / "eval" / "eval.json", "--output-dir", tmp_path / "paired", *args)
    paired = read_json(tmp_path / "paired" / "eval" / "eval.json")
    assert list(paired["drafts"]) == [f"{trained_name} (stored)", "random_draft"]
    for name, r in [(trained_name, first), ("random_draft", paired["drafts"]["random_draft"])]:
        assert abs(r["mean_acceptance_length"] - first_conversations_length(vllm_report, name, 2)) <= 0.05, name
        assert r["lossless"] is True and len(r["per_conversation"]) == one["num_conversations"] == 2
    random = paired["drafts"]["random_draft"]
    assert paired["drafts"][f"{trained_name} (stored)"]["per_conversation"] == first["per_conversation"]
    vs = random["vs_first"]  # the difference and interval of the two drafts' counts, as if both had run together
    assert vs["difference"] == pytest.approx(random["mean_acceptance_length"] - first["mean_acceptance_length"])
    assert vs["difference"] < 0
    assert vs["interval_95"] == pytest.approx(bootstrap_interval(random["per_conversation"], first["per_conversation"]))
    # a stored report of other settings is refused before anything runs; so are its answers if they differ
    assert_user_error(stage("05_evaluate.py", "--backend", "transformers", "--draft-path", random_draft,
                            "--data-dir", data_dir, "--paired-with", tmp_path / "one" / "eval" / "eval.json",
                            "--output-dir", tmp_path / "refused", *args, "--num-speculative-tokens", 2,
                            check=False), "was measured with num_speculative_tokens 3 (this run: 2)")
    older = dict(one)  # a report from before the prompts' hash, whose answers were longer than this run's
    del older["prompts_sha256"]
    older["drafts"] = {trained_name: dict(first, generated_tokens=10 ** 6)}
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert_user_error(stage("05_evaluate.py", "--backend", "transformers", "--draft-path", random_draft,
                            "--data-dir", data_dir, "--paired-with", tmp_path / "older.json",
                            "--output-dir", tmp_path / "refused", *args, check=False),
                      "answered with 1000000 tokens, this run's verifier with")


def test_bad_input_exits_2_with_one_line(tmp_path, trained, data_dir, other_verifier, verifier):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    best = trained / "checkpoints" / "best"
    damaged = {}  # copies of the checkpoint, each with one file cut short or gone
    for name, file, keep in [("torn_weights", "model.safetensors", 0.5), ("no_weights", "model.safetensors", None),
                             ("torn_config", "config.json", 0.5)]:
        damaged[name] = tmp_path / name
        shutil.copytree(best, damaged[name])
        data = (damaged[name] / file).read_bytes()
        (damaged[name] / file).unlink()
        if keep:
            (damaged[name] / file).write_bytes(data[:int(len(data) * keep)])
    no_tokenizer = tmp_path / "no_tokenizer"  # the verifier's config and weights alone
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).symlink_to(os.path.join(verifier, name))
    cases = [
        (["--draft-path", best, "--verifier-path", other_verifier], "hidden size"),
        (["--draft-path", best, "--prompts", empty], "no prompts"),
        (["--draft-path", best, "--num-speculative-tokens", 0], "--num-speculative-tokens"),
        (["--draft-path", best, "--tensor-parallel-size", 0], "--tensor-parallel-size"),
        (["--draft-path", best, "--gpu-memory-utilization", 1.5], "--gpu-memory-utilization"),
        (["--draft-path", tmp_path], "not a draft checkpoint"),
        (["--draft-path", best, "--compare", best], "the same draft is given twice"),
        (["--draft-path", best, "--temperature", "nan"], "--temperature: nan: must be at least 0"),
        (["--draft-path", best, "--max-turns", 0], "--max-turns"),
        (["--draft-path", best, "--backend", "transformers", "--device", "cuda"], "no CUDA"),
        (["--draft-path", damaged["torn_weights"]], "model.safetensors is truncated"),
        (["--draft-path", damaged["no_weights"], "--backend", "transformers"], "has no model.safetensors"),
        (["--draft-path", damaged["torn_config"]], "config.json is damaged"),
        (["--draft-path", best, "--verifier-path", no_tokenizer], "tokenizer does not load"),
        (["--draft-path", best, "--paired-with", empty], "--paired-with %s: not a readable 05 report" % empty),
        (["--draft-path", best, "--paired-with", f"{empty}:a"], "not a readable 05 report"),
    ]
    assert_bad_inputs("05_evaluate.py", cases, lambda i: ["--data-dir", data_dir, "--output-dir", tmp_path / f"out{i}"])


@pytest.mark.slow
def test_vllm_with_tensor_parallel_2(tmp_path, tokenizer, data_dir):
    """05 as a multi-GPU verifier is served: the engine split over 2 ranks (2 CPU processes here) for a tiny
    random Llama, a draft of its shape, greedy output identical with and without it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.draft import build_draft, save_servable
    verifier, draft = tmp_path / "llama", tmp_path / "draft"
    torch.manual_seed(0)
    # head dim 64 (vLLM's CPU attention kernels), heads split over the 2 ranks
    LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=len(tokenizer), tie_word_embeddings=True,
                                 eos_token_id=2, pad_token_id=2, bos_token_id=1)).save_pretrained(verifier)
    tokenizer.save_pretrained(verifier)
    save_servable(build_draft(str(verifier), [1, 2, 3], str(data_dir / "vocab_mapping"), 3, "sdpa"), str(draft))
    log = stage("05_evaluate.py", "--verifier-path", verifier, "--draft-path", draft, "--data-dir", data_dir,
                "--output-dir", tmp_path, "--tensor-parallel-size", 2, "--num-prompts", 2, "--max-new-tokens", 16,
                "--max-turns", 1, "--max-prompt-len", 256,
                env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}).stdout  # one core per rank: the machine has one NUMA node
    assert "tensor_parallel_size=2" in log.replace(" ", "")
    report = read_json(tmp_path / "eval" / "eval.json")["drafts"]["draft"]
    assert report["lossless"] is True and report["drafts"] > 0


def test_drafts_of_two_runs_get_their_own_rows(tmp_path):
    """Two runs' `checkpoints/best` both point at an `epoch_2`: each keeps a row of its own, named by as
    many folders as tell them apart (they once shared one row, silently)."""
    evaluate_stage = stage_module("05_evaluate")
    for run in ("ttt5", "lk"):
        (tmp_path / run / "checkpoints" / "epoch_2").mkdir(parents=True)
        (tmp_path / run / "checkpoints" / "best").symlink_to("epoch_2")
    (tmp_path / "solo").mkdir()
    paths = [str(tmp_path / "ttt5/checkpoints/best"), str(tmp_path / "lk/checkpoints/best/"), str(tmp_path / "solo")]
    assert evaluate_stage.draft_names(paths) == {
        "ttt5/checkpoints/epoch_2": paths[0], "lk/checkpoints/epoch_2": paths[1], "solo": paths[2]}


def test_bootstrap_interval_of_a_draft_and_of_a_paired_difference():
    from common.evaluate import bootstrap_interval
    same = [[10, 5]] * 20  # every conversation accepts 0.5 draft tokens a step
    assert bootstrap_interval(same) == pytest.approx([1.5, 1.5])
    varied = [[10 + i, (i * 7) % 13] for i in range(30)]
    low, high = bootstrap_interval(varied)
    point = 1 + sum(a for _, a in varied) / sum(s for s, _ in varied)
    assert low < point < high and high - low < 0.5
    assert bootstrap_interval(varied, varied) == pytest.approx([0.0, 0.0])  # paired: a draft against itself
    better = [[s, a + 2] for s, a in varied]  # two more accepted tokens in every conversation
    assert bootstrap_interval(better, varied)[0] > 0
