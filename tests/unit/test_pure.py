"""The fast tier: pure pieces of the pipeline in milliseconds, no model, no files (`pytest tests/unit`)."""
import argparse
import json
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from common.cli import parse_rows
from common.config import EvalConfig, RegenConfig, TrainConfig, device, number
from common.errors import UserError
from common.extract import plan_batches
from common.loader import epoch_batches, split_rows
from common.regenerate import LOOP_STOP_TOKENS, cut_loop, stuck_in_loop
from common.train import lr_scale, noised
from common.vocab import build_mapping


def schedule(**kw):
    return SimpleNamespace(**{"warmup_steps": None, "warmup_ratio": 0.1, "scheduler": "cosine", "min_lr_ratio": 0.0,
                              **kw})


def test_lr_scale_warms_up_linearly_then_decays_to_the_floor():
    s = schedule()
    assert [lr_scale(i, 100, s) for i in range(3)] == [0.1, 0.2, 0.3]  # 10 warmup steps
    assert lr_scale(10, 100, s) == pytest.approx(1.0)
    assert lr_scale(55, 100, s) == pytest.approx(0.5)  # cosine's midpoint
    assert lr_scale(100, 100, s) == pytest.approx(0.0)
    assert lr_scale(100, 100, schedule(min_lr_ratio=0.1)) == pytest.approx(0.1)
    assert lr_scale(55, 100, schedule(scheduler="linear")) == pytest.approx(0.5)
    assert lr_scale(99, 100, schedule(scheduler="none")) == 1.0
    assert lr_scale(0, 100, schedule(warmup_steps=4)) == 0.25  # steps win over the ratio


def test_plan_batches_bounds_the_padded_size_and_keeps_every_row_once():
    lengths = {0: 5, 1: 9, 2: 3, 3: 9, 4: 1}
    batches = plan_batches(lengths, 18)
    assert sorted(i for b in batches for i in b) == list(lengths)
    assert all(len(b) * max(lengths[i] for i in b) <= 18 for b in batches)
    assert batches[0] == [1, 3]  # longest first, ties by id
    with pytest.raises(UserError, match="--max-tokens-per-batch 8 is smaller than the longest row"):
        plan_batches(lengths, 8)


def test_split_rows_is_a_deterministic_partition():
    train, val = split_rows(100, 0.05, seed=3)
    assert len(val) == 5 and sorted(train + val) == list(range(100))
    assert (train, val) == split_rows(100, 0.05, seed=3) and val != split_rows(100, 0.05, seed=4)[1]
    assert split_rows(7, 0.0, 0) == (list(range(7)), [])
    with pytest.raises(UserError, match="leaves no training rows"):
        split_rows(1, 0.5, 0)


def test_epoch_batches_pack_every_row_once_within_the_length():
    lengths = [100, 700, 300, 50, 1000, 20, 512, 64] * 4
    batches = epoch_batches(lengths, 1024, seed=0, epoch=0, rank=0, world=1)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 1024 for b in batches)
    assert batches == epoch_batches(lengths, 1024, seed=0, epoch=0, rank=0, world=1)
    assert batches != epoch_batches(lengths, 1024, seed=0, epoch=1, rank=0, world=1)
    halves = [epoch_batches(lengths, 1024, seed=0, epoch=0, rank=r, world=2) for r in (0, 1)]
    assert not {i for b in halves[0] for i in b} & {i for b in halves[1] for i in b}  # ranks share no row


def test_build_mapping_keeps_the_most_frequent_tokens_lowest_id_first():
    freq = torch.tensor([0, 5, 2, 5, 0, 9])
    d2t, t2d, stats = build_mapping(freq, 3)
    chosen = [i + int(d) for i, d in enumerate(d2t)]
    assert chosen == [1, 3, 5] and t2d.tolist() == [False, True, False, True, False, True]
    assert stats["coverage"] == pytest.approx(19 / 21) and stats["filled_unseen"] == 0
    d2t, _, stats = build_mapping(freq, 5)  # more room than seen tokens: unseen fillers by lowest id
    assert [i + int(d) for i, d in enumerate(d2t)] == [0, 1, 2, 3, 5] and stats["filled_unseen"] == 1


def test_cut_loop_keeps_two_periods_of_a_repeating_tail():
    text = list(range(10))
    looped = text + [7, 8, 9] * 20
    cut = cut_loop(looped)
    assert cut is not None and cut[-6:] == [7, 8, 9, 7, 8, 9] and len(cut) < len(looped)
    assert cut_loop(text + [7, 8, 9] * 3) is None  # too short to be a loop
    assert cut_loop(list(range(200))) is None
    assert not stuck_in_loop(looped)  # 60 repeating tokens: below the stop length
    long_loop = text + [4, 2] * LOOP_STOP_TOKENS
    assert stuck_in_loop(long_loop[:len(long_loop) // 16 * 16])


def test_noise_is_absolute_or_a_share_of_each_aux_layers_rms():
    torch.manual_seed(0)
    hidden, scales = 64, [1.0, 50.0]  # an early layer's states are small, a late one's large
    hs = torch.cat([s * torch.randn(2, 512, hidden) for s in scales], dim=-1)
    for scale, want in [("absolute", [0.1, 0.1]), ("rms", [0.1 * s for s in scales])]:
        noise = (noised(hs, hidden, 0.1, scale) - hs).unflatten(-1, (2, hidden))
        got = [noise[..., i, :].std().item() for i in range(2)]
        assert got == pytest.approx(want, rel=0.05), scale


def test_number_checks_ranges_and_nan_in_one_line():
    rate = number(float, 0, 1, low_open=True)
    assert rate("0.5") == 0.5
    for bad in ["0", "1.5", "nan"]:
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be in \(0, 1\]"):
            rate(bad)
    count = number(int, 1)
    assert count("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="must be at least 1"):
        count("0")
    with pytest.raises(ValueError):
        count("2.5")
    assert number(float, 0, low_open=True).rule == "a positive number"
    assert device("cuda:1") == "cuda:1" and device("auto") == "auto"
    with pytest.raises(argparse.ArgumentTypeError):
        device("gpu")
    assert parse_rows("0-10") == (0, 10) and parse_rows(None) is None
    for bad in ["10-0", "a-b", "-1-3"]:
        with pytest.raises(UserError, match="--rows"):
            parse_rows(bad)


def script_parser(name: str):
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location(name[:-3], os.path.join(os.path.dirname(__file__), "..", "..", name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


@pytest.mark.parametrize("yaml_text, argv, pack", [
    ("max_seq_len: 300\n", [], 2048),  # the top-level key is 01's row length, not 04's pack
    ("max_seq_len: 300\ntrain:\n  max_seq_len: 512\n", [], 512),  # the old name, in 04's section
    ("train:\n  pack_tokens: 640\n", [], 640),
    ("train:\n  pack_tokens: 640\n", ["--max-seq-len", "128"], 128),  # the old flag, on the command line
])
def test_04s_pack_length_has_its_own_name_and_keeps_the_old_one(tmp_path, yaml_text, argv, pack):
    from common.cli import parse_args
    config = tmp_path / "c.yaml"
    config.write_text(yaml_text)
    args = parse_args(script_parser("04_train.py"), "04_train",
                      ["--config", str(config), "--data-dir", "d", "--output-dir", "o", *argv])
    assert args.pack_tokens == pack and not hasattr(args, "max_seq_len")


def test_a_checkpoint_saved_under_the_old_flag_name_is_compared_under_the_new():
    from common.train import check_resume
    old = {"settings": {"--max-seq-len": 512}, "args": {}}
    with pytest.raises(UserError, match=r"--pack-tokens 512 \(this run: 1024\)"):
        check_resume("step_2", old, {"--pack-tokens": 1024}, TrainConfig())
    check_resume("step_2", old, {"--pack-tokens": 512}, TrainConfig())


def test_the_layout_finds_a_data_dir_from_any_of_its_folders():
    from common.layout import DataDir, prepared_of, shard, shard_span, states_of
    data = DataDir("/d")
    for path in ["/d", "/d/prepared", "/d/hidden_states/", "/d/hidden_states/rows_0-64", "/d/vocab_mapping"]:
        assert DataDir.holding(path).root == "/d", path
    assert shard(0, 64) == "rows_0-64" and shard_span("/d/prepared/rows_0-64/") == (0, 64)
    assert shard_span("/d/prepared/rows_x") is None and shard_span("/d/prepared") is None
    assert states_of("/d/prepared/rows_0-64/", data) == "/d/hidden_states/rows_0-64"
    assert prepared_of("/d/hidden_states/rows_0-64") == "/d/prepared/rows_0-64" == data.prepared("rows_0-64")
    assert data.prepared() == "/d/prepared" and data.vocab_mapping == "/d/vocab_mapping"


def test_one_validator_says_what_is_wrong_with_a_row_file(tmp_path):
    from common.rows import row_file, row_index, row_problem, save_row
    path = row_file(str(tmp_path), 7)
    assert row_index(path) == 7
    ids = [5, 6, 7, 8]
    save_row(path, ids, torch.randn(4, 3, 16).bfloat16(), [0, 1, 1, 1])
    assert row_problem(path, 4, 3, 16, fp8=False, token_ids=ids) is None
    assert row_problem(path, 4, 3, 16, fp8=True) == "holding other tensors (hidden_states, loss_mask, token_ids)"
    assert row_problem(path, 4, 3, 16, token_ids=[5, 6, 7, 9]) == "of other tokens than its row"
    assert row_problem(path, 5, 3, 16).startswith("of the wrong shape: states [4, 3, 16]")
    assert row_problem(row_file(str(tmp_path), 8), 4, 3, 16) == "missing"
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-10])
    assert row_problem(path, 4, 3, 16).startswith("truncated or damaged")
    open(path, "wb").write(b"\0" * len(data))
    assert row_problem(path, 4, 3, 16) == "damaged (no readable header)"
    fp8 = row_file(str(tmp_path), 9)
    save_row(fp8, ids, torch.randn(4, 3, 16), [0, 1, 1, 1], fp8=True)
    assert row_problem(fp8, 4, 3, 16, fp8=True, token_ids=ids) is None
    assert row_problem(fp8, 4, 3, 16, fp8=False) is not None


def test_the_stage_registry_names_every_script_once():
    import glob
    import os
    from common.cli import SECTIONS
    from common.layout import BY_MANIFEST, STAGES
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    scripts = {os.path.basename(p) for p in glob.glob(os.path.join(root, "0*.py"))} | {"export_speculators_data.py"}
    assert {s.script for s in STAGES} == scripts and len(set(SECTIONS.values())) == len(STAGES)
    assert BY_MANIFEST["hidden_states"].script == "03_extract_hidden_states.py"


def test_a_config_built_in_code_meets_the_flags_checks():
    assert TrainConfig().optimizer == "muon" and TrainConfig().norm_before_fc  # the measured recipe is the default
    with pytest.raises(UserError, match=r"^--lr 0.0: must be a positive number"):
        TrainConfig(lr=0.0)
    with pytest.raises(UserError, match=r"^--optimizer sgd: choose from adamw, muon"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(UserError, match="--muon-lr sets the Muon group's lr"):
        TrainConfig(optimizer="adamw", muon_lr=1e-3)
    with pytest.raises(UserError, match="--compile-wait changes how --compile compiles"):
        TrainConfig(compile_wait=True)
    with pytest.raises(UserError, match="--on-policy has the server write the replies"):
        TrainConfig(on_policy=True)
    with pytest.raises(UserError, match=r"^--top-p 0.0: must be in \(0, 1\]"):
        RegenConfig(top_p=0.0)
    with pytest.raises(UserError, match=r"^--device gpu: use cuda"):
        RegenConfig(device="gpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainConfig().lr = 1.0  # frozen: a setting is resolved once, never changed on the way


def test_each_config_field_is_a_flag_with_its_default_and_help():
    for script, cls in (("04_train.py", TrainConfig), ("05_evaluate.py", EvalConfig), ("01_prepare_dataset.py", RegenConfig)):
        parser = script_parser(script)
        actions = {a.dest: a for a in parser._actions}  # noqa: SLF001 - argparse lists its flags nowhere public
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default
                assert actions[f.name].default == default and actions[f.name].help == f.metadata["help"], (script, f.name)
    assert EvalConfig(max_prompt_len=100, max_new_tokens=20).max_model_len == 100 + 20 + 3 + 16


def test_one_compute_dtype_rule():
    from common.verifier import compute_dtype
    assert compute_dtype("cuda") == compute_dtype("cuda", generating=True) == "bfloat16"
    assert compute_dtype("cpu", generating=True) == "float32"  # generated text reproduces float32's greedy text
    assert compute_dtype("cpu") in ("bfloat16", "float32")  # bf16 only where the CPU multiplies it natively


def test_a_stored_draft_that_was_not_first_in_its_run_heads_the_table_without_its_old_difference(tmp_path):
    from common.evaluate import stored_reference
    counts = {"generated_tokens": 10, "mean_acceptance_length": 2.0, "acceptance_rate_per_pos": [0.5], "drafts": 4,
              "accepted_tokens": 4, "lossless": True, "per_conversation": [[2, 2], [2, 2]]}
    report = {"temperature": 0, "num_conversations": 2, "drafts": {
        "a": counts, "b": dict(counts, vs_first={"difference": 0.1, "interval_95": [0.0, 0.2]})}}
    (tmp_path / "eval.json").write_text(json.dumps(report))
    name, stored = stored_reference(f"{tmp_path / 'eval.json'}:b", {"temperature": 0, "num_conversations": 2})
    assert name == "b (stored)" and "vs_first" not in stored and stored["per_conversation"] == counts["per_conversation"]
