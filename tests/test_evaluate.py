"""Stage 05 with real vLLM (the CPU build) and the real verifier: trained vs random draft, both backends."""
import pytest

from conftest import assert_user_error, read_json, stage

EVAL_ARGS = ["--num-prompts", 6, "--max-new-tokens", 48, "--max-turns", 2, "--max-prompt-len", 512]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, verifier, data_dir):
    """An untrained draft of the right shape (its embedding and lm_head are the verifier's)."""
    from common.draft import build_draft, save_servable
    folder = tmp_path_factory.mktemp("drafts") / "random_draft"
    save_servable(build_draft(verifier, [2, 15, 27], str(data_dir / "vocab_mapping"), 3, "sdpa"), str(folder))
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
    assert vllm_report["baseline_tokens_per_s"] > 0


@pytest.mark.slow
def test_transformers_backend_agrees_with_vllm(tmp_path, vllm_report, trained, random_draft, data_dir):
    report = evaluate(tmp_path, "transformers", trained, random_draft, data_dir)
    for name, r in vllm_report["drafts"].items():
        assert abs(report["drafts"][name]["mean_acceptance_length"] - r["mean_acceptance_length"]) <= 0.05, name
        assert report["drafts"][name]["lossless"] is True


def test_bad_input_exits_2_with_one_line(tmp_path, trained, data_dir, other_verifier):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    best = trained / "checkpoints" / "best"
    cases = [
        (["--draft-path", best, "--verifier-path", other_verifier], "hidden size"),
        (["--draft-path", best, "--prompts", empty], "no prompts"),
        (["--draft-path", best, "--num-speculative-tokens", 0], "--num-speculative-tokens"),
        (["--draft-path", tmp_path], "not a draft checkpoint"),
    ]
    for args, words in cases:
        assert_user_error(stage("05_evaluate.py", "--data-dir", data_dir, "--output-dir", tmp_path, *args,
                                check=False), words)
