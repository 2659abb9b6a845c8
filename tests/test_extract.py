"""Stage 03 on the real verifier: layout, equality with an unbatched forward, resume, both backends."""
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from common.data import load_prepared
from conftest import ROWS, SEQ, assert_bad_inputs, assert_user_error, kill_at, read_json, stage


def test_files_match_an_unbatched_forward(verifier, prepared_dir, hs_dir):
    from transformers import AutoModelForCausalLM
    manifest = read_json(hs_dir / "manifest.json")  # computed in the dtype the run used (bf16 on a CPU with AMX)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=getattr(torch, manifest["flags"]["dtype"])).eval()
    aux = manifest["aux_layers"]
    assert aux == [2, 15, 27] and manifest["final_layer"] == 30
    ds = load_prepared(str(prepared_dir))
    lengths = ds["seq_len"]
    # the longest and the shortest row: batched with padding in the run, alone here
    for i in (lengths.index(max(lengths)), lengths.index(min(lengths))):
        f = load_file(hs_dir / f"hs_{i}.safetensors")
        n = lengths[i]
        assert f["hidden_states"].shape == (n, 4, 576) and f["hidden_states"].dtype == torch.bfloat16
        assert f["token_ids"].tolist() == ds[i]["input_ids"] and f["loss_mask"].tolist() == ds[i]["loss_mask"]
        with torch.no_grad():
            hs = model(torch.tensor([ds[i]["input_ids"]]), output_hidden_states=True).hidden_states
        for slot, k in enumerate(aux):
            torch.testing.assert_close(f["hidden_states"][:, slot].float(), hs[k][0].float(), rtol=0.02, atol=0.02)
        final = f["hidden_states"][:, 3]
        # the final slot is before the final norm: norm(final) is transformers' last (normed) entry
        torch.testing.assert_close(model.model.norm(final.to(model.dtype)).float(), hs[-1][0].float(), rtol=0.02, atol=0.05)
        assert not torch.allclose(final.float(), hs[-1][0].float(), atol=0.5)
    counts = manifest["counts"]
    assert counts["bytes_per_token"] >= 4 * 576 * 2 and counts["rows"] == len(ds)
    # the manifest records settings, never a live object's repr
    assert not any(k.startswith("_") or " object at 0x" in str(v) for k, v in manifest["flags"].items())


def test_resume_after_kills_and_corrupt_file_redone(tmp_path, data_dir, hs_dir):
    """One extraction SIGKILLed after its first row file, then early, then near the end (each rerun killed at the
    next point); a truncated file planted; the next run redoes it, keeps the rest and matches the uninterrupted run."""
    shutil.copytree(data_dir / "prepared", tmp_path / "prepared")
    args = ["03_extract_hidden_states.py", "--data-dir", tmp_path,
            "--max-tokens-per-batch", 2048, "--dtype", "float32"]  # the budget and dtype of the uninterrupted run (fixture)
    out = tmp_path / "hidden_states" / f"rows_0-{ROWS}"
    total = sum(f.endswith(".safetensors") for f in os.listdir(hs_dir))
    for share in (0.0, 0.2, 0.9):  # after the first row file, early, near the end
        files = max(1, int(share * total))
        kill_at(args, lambda files=files: out.exists() and sum(f.endswith(".safetensors") for f in os.listdir(out)) >= files)
    done = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert 0 < len(done) < len(os.listdir(hs_dir)) and not (out / "manifest.json").exists()
    # plant a truncated file, as a crash in the middle of a write on another filesystem would leave
    victim = out / done[0]
    victim.write_bytes(victim.read_bytes()[:1000])
    proc = stage(*args)
    assert "corrupt" in proc.stdout
    counts = read_json(out / "manifest.json")["counts"]
    assert counts["corrupt_redone"] == 1 and counts["skipped_complete"] == len(done) - 1
    for name in os.listdir(hs_dir):
        if name.endswith(".safetensors"):
            a, b = load_file(out / name), load_file(hs_dir / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # a third run finds everything complete
    proc = stage("03_extract_hidden_states.py", "--data-dir", tmp_path)
    assert f"{ROWS}" in proc.stdout and read_json(out / "manifest.json")["counts"]["extracted"] == 0


def test_fp8_states_read_by_hs_connectors_and_trained_on(tmp_path, data_dir, hs_dir):
    """--hidden-states-dtype fp8: about half the bytes, hs-connectors' FP8Transfer dequantizes them to the
    bf16 states within fp8's precision, and 04 trains on them."""
    from hs_connectors.transfer import FP8Transfer
    shutil.copytree(data_dir / "prepared", tmp_path / "prepared")
    shutil.copytree(data_dir / "vocab_mapping", tmp_path / "vocab_mapping")
    stage("03_extract_hidden_states.py", "--data-dir", tmp_path, "--max-tokens-per-batch", 2048,
          "--hidden-states-dtype", "fp8", "--dtype", "float32")  # the fixture's: fp8's rounding alone is compared
    out = tmp_path / "hidden_states" / f"rows_0-{ROWS}"
    fp8, bf16 = read_json(out / "manifest.json"), read_json(hs_dir / "manifest.json")
    assert fp8["hidden_states_dtype"] == "fp8"
    ratio = fp8["counts"]["bytes_per_token"] / bf16["counts"]["bytes_per_token"]
    assert 0.45 < ratio < 0.55, ratio
    reader = FP8Transfer(out)
    for i in range(0, bf16["counts"]["rows"], 7):
        a, b = reader.get_cached(i), load_file(hs_dir / f"hs_{i}.safetensors")
        assert a is not None and a["hidden_states"].dtype == torch.bfloat16 and torch.equal(a["token_ids"], b["token_ids"])
        cos = torch.nn.functional.cosine_similarity(a["hidden_states"].float(), b["hidden_states"].float(), dim=-1)
        assert cos.min() > 0.99, (i, cos.min())
    # bf16 states on the same folder are refused rather than mixed in
    assert_user_error(stage("03_extract_hidden_states.py", "--data-dir", tmp_path, check=False), "hidden-states-dtype")
    stage("04_train.py", "--data-dir", tmp_path, "--output-dir", tmp_path / "out", "--max-steps", 3,
          "--max-seq-len", 1024, "--num-workers", 1)
    assert (tmp_path / "out" / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_vllm_backend_matches_transformers(tmp_path, data_dir, hs_dir):
    os.makedirs(tmp_path / "prepared")
    shutil.copytree(data_dir / "prepared" / f"rows_0-{ROWS}", tmp_path / "prepared" / f"rows_0-{ROWS}")
    stage("03_extract_hidden_states.py", "--data-dir", tmp_path, "--backend", "vllm", "--max-tokens-per-batch", 4096,
          "--dtype", "float32")  # as the reference: two implementations compared beyond bf16's rounding
    out = tmp_path / "hidden_states" / f"rows_0-{ROWS}"
    assert read_json(out / "manifest.json")["aux_layers"] == read_json(hs_dir / "manifest.json")["aux_layers"]
    names = [n for n in os.listdir(hs_dir) if n.endswith(".safetensors")]
    assert sorted(names) == sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    for name in names:
        a, b = load_file(out / name), load_file(hs_dir / name)
        assert torch.equal(a["token_ids"], b["token_ids"]) and a["hidden_states"].shape == b["hidden_states"].shape
        cos = torch.nn.functional.cosine_similarity(a["hidden_states"].float(), b["hidden_states"].float(), dim=-1)
        assert cos.min() >= 0.999, (name, cos.min(dim=0))


def test_bf16_states_match_float32_within_its_precision(tmp_path, data_dir, hs_dir):
    """--dtype bfloat16, 03's default on a GPU and on a CPU with AMX (2.9x float32's tokens/s on 2 cores), gives the
    float32 run's states within bf16's precision, and its manifest says which dtype ran."""
    # the first 16 conversations of the fixture's 64 (the same shuffle): its first rows, in a quarter of the time
    # bfloat16 takes where it is emulated
    stage("01_prepare_dataset.py", "--data-dir", tmp_path, "--num-samples", 16, "--max-seq-len", SEQ)
    stage("03_extract_hidden_states.py", "--data-dir", tmp_path, "--max-tokens-per-batch", 2048, "--dtype", "bfloat16")
    out = tmp_path / "hidden_states" / "rows_0-16"
    assert read_json(out / "manifest.json")["flags"]["dtype"] == "bfloat16"
    assert read_json(hs_dir / "manifest.json")["flags"]["dtype"] == "float32"
    cosines = []
    for name in (n for n in os.listdir(out) if n.endswith(".safetensors")):
        a, b = load_file(out / name), load_file(hs_dir / name)
        assert torch.equal(a["token_ids"], b["token_ids"])
        assert not torch.equal(a["hidden_states"], b["hidden_states"]), "the bf16 run computed in float32"
        cosines.append(torch.nn.functional.cosine_similarity(a["hidden_states"].float(), b["hidden_states"].float(), dim=-1))
    cos = torch.cat(cosines)
    # a few tokens drift further in bf16 (0.979 at worst on one of ~9,000 here), as on a GPU, where 03 always ran bf16
    assert cos.mean() >= 0.9995 and (cos < 0.99).float().mean() < 1e-3 and cos.min() >= 0.95, (cos.min(dim=0), cos.mean())


def test_bad_input_exits_2_with_one_line(tmp_path, data_dir, foreign_verifier):
    cases = [
        (["--layers", "2", "40"], "outside"),
        (["--max-tokens-per-batch", "100"], "longest row"),
        (["--backend", "onnx"], "invalid choice"),
        (["--verifier-path", foreign_verifier], "another tokenizer"),
        (["--device", "banana"], "use cuda"),
        (["--device", "cuda"], "no CUDA"),
        (["--writer-threads", "0"], "--writer-threads"),
    ]
    for i in range(len(cases)):  # a data dir each: the runs go two at a time
        shutil.copytree(data_dir / "prepared", tmp_path / f"d{i}" / "prepared")
    assert_bad_inputs("03_extract_hidden_states.py", cases, lambda i: ["--data-dir", tmp_path / f"d{i}"])
    assert not list(tmp_path.glob("d*/hidden_states/*/manifest.json"))


def test_default_aux_layers_are_distinct_for_small_verifiers():
    from common.verifier import default_aux_layers
    assert default_aux_layers(30) == [2, 15, 27] and default_aux_layers(61) == [2, 30, 58]  # speculators' choice
    for n in range(4, 9):
        ids = default_aux_layers(n)
        assert len(ids) == 3 and ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < n, (n, ids)


def test_host_out_of_memory_is_split_like_gpu_out_of_memory():
    """The CPU allocator's failure (what a host without memory for a batch raises) is taken for out of
    memory, so 03 splits the batch as it does for CUDA's; other errors are not."""
    from common.errors import is_oom
    try:
        torch.empty(2 ** 50)  # 4 PB: refused by the real allocator
    except RuntimeError as e:
        assert is_oom(e)
    else:
        raise AssertionError("the allocator gave 4 PB")
    assert is_oom(MemoryError()) and not is_oom(RuntimeError("shape mismatch"))


@pytest.mark.slow
def test_extraction_under_a_memory_limit_splits_batches_and_matches(tmp_path, data_dir, hs_dir):
    """03 under a host memory limit too small for its 16K-token batches (RLIMIT_DATA, what the allocator
    meets on a full host): the batch is split and retried, the log says so, and the files hold the
    states of the unconstrained run. The limit climbs a ladder (what a process needs differs between
    machines); the first limit that extracts must be one where batches were split."""
    shutil.copytree(data_dir / "prepared", tmp_path / "prepared")
    for gb in [1 + 0.25 * k for k in range(21)]:
        shutil.rmtree(tmp_path / "hidden_states", ignore_errors=True)
        proc = stage("03_extract_hidden_states.py", "--data-dir", tmp_path, "--max-tokens-per-batch", 16384,
                     "--dtype", "float32", check=False, memory_limit=int(gb * 2**30))
        if proc.returncode == 0:
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "out of memory on a batch of" in proc.stdout and "splitting it in two" in proc.stdout, gb
    out = tmp_path / "hidden_states" / f"rows_0-{ROWS}"
    for name in os.listdir(hs_dir):
        if name.endswith(".safetensors"):  # batched with other rows and padding: equal within bf16 rounding
            a, b = load_file(out / name), load_file(hs_dir / name)
            assert torch.equal(a["token_ids"], b["token_ids"]), name
            torch.testing.assert_close(a["hidden_states"], b["hidden_states"], rtol=1.6e-2, atol=1e-3, msg=name)


def test_a_vllm_that_returns_too_few_slots_is_one_line():
    """vLLM before PR #46973 stored one state fewer for DeepSeek-family verifiers; that vLLM cannot be installed
    beside this one, so its answer (the engine's output dict) is written here: 03 must stop on it with one line
    naming the vLLM needed, not write rows that 04 rejects later."""
    from types import SimpleNamespace

    import torch

    from common.errors import UserError
    from common.vllm_extract import extract_vllm
    rows = {0: {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}}
    old_vllm = SimpleNamespace(slots=4, run=lambda lists: [
        {"token_ids": torch.tensor(t), "hidden_states": torch.zeros(len(t), 3, 8)} for t in lists])
    with pytest.raises(UserError, match="returned 3 hidden-state slots.*not 4.*PR #46973"):
        extract_vllm(old_vllm, rows, "/nonexistent", None, 64, None)
