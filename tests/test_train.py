"""Stage 04 on real extracted rows of the real verifier."""
import json
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TRAIN_ARGS, assert_bad_inputs, assert_user_error, kill_at, read_json, records, stage


def test_loss_falls_and_checkpoints_are_complete(trained):
    train = records(trained, "train")
    assert len(train) >= 4
    assert train[-1]["loss"] < 0.8 * train[0]["loss"]
    val = records(trained, "val")
    assert len(val) == 4 and val[-1]["acc_pos"][0] > val[0]["acc_pos"][0] * 0.9
    ckpts = trained / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["best", "epoch_1", "epoch_2", "epoch_3", "epoch_4", "latest"]
    assert os.readlink(ckpts / "latest") == "epoch_4"
    best = max(val, key=lambda r: r["est_accept_len"])["epoch"]  # --best-by accept, the default
    assert os.readlink(ckpts / "best") == f"epoch_{best}"
    assert (trained / "training.png").stat().st_size > 10_000


def test_checkpoint_is_speculators_eagle3_and_reloads(trained, data_dir, hs_dir):
    import numpy as np

    from common.draft import load_draft
    ckpt = trained / "checkpoints" / "latest"
    cfg = read_json(ckpt / "config.json")
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["norm_before_fc"] is True and cfg["norm_output"] is True  # the fixture trains Eagle-3.1 norms
    assert cfg["eagle_aux_hidden_state_layer_ids"] == read_json(hs_dir / "manifest.json")["aux_layers"] == [2, 15, 27]
    weights = load_file(ckpt / "model.safetensors")
    assert np.array_equal(weights["d2t"].numpy(), np.load(data_dir / "vocab_mapping" / "d2t.npy"))
    assert np.array_equal(weights["t2d"].numpy(), np.load(data_dir / "vocab_mapping" / "t2d.npy"))
    assert "verifier_lm_head.weight" not in weights
    model = load_draft(str(ckpt))
    state = torch.load(ckpt / "training_state.pt", weights_only=False)["model"]
    for name, value in state.items():  # the servable bf16 copy is the trained weights, rounded
        torch.testing.assert_close(model.state_dict()[name].float(), value.bfloat16().float())


KILL_POINTS_04 = {  # before any checkpoint, inside a checkpoint's save, just after one
    "first_steps": lambda out: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0,
    "saving": lambda out: (out / "checkpoints" / ".tmp.epoch_2").exists(),
    "after_checkpoint": lambda out: (out / "checkpoints" / "epoch_2").exists(),
}


def test_killed_at_each_point_and_resumed_matches_uninterrupted(tmp_path, data_dir, trained):
    """One run SIGKILLed at each point in turn, resumed after each kill: the point after it is met by a resumed run,
    and the last resume ends where the uninterrupted run (the fixture) ends."""
    out = tmp_path / "run"
    args = ["04_train.py", "--data-dir", data_dir, "--output-dir", out, *TRAIN_ARGS]
    for i, point in enumerate(KILL_POINTS_04):
        kill_at(args + (["--resume"] if i else []), lambda point=point: KILL_POINTS_04[point](out))
    assert not (out / "checkpoints" / "epoch_4").exists()
    stage(*args, "--resume")
    final = torch.load(out / "checkpoints" / "epoch_4" / "training_state.pt", weights_only=False)
    reference = torch.load(trained / "checkpoints" / "epoch_4" / "training_state.pt", weights_only=False)
    assert final["step"] == reference["step"]
    for name in reference["model"]:
        torch.testing.assert_close(final["model"][name], reference["model"][name], rtol=1e-4, atol=1e-5)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["split"] == "train"]
    assert len(steps) == len(set(steps))  # each step logged once, the replayed ones included
    # resuming with another TTT depth or MLP width is refused
    assert_user_error(stage(*args, "--resume", "--ttt-steps", 2, check=False), "new --output-dir")
    assert_user_error(stage(*args, "--resume", "--draft-intermediate-size", 2048, check=False), "new --output-dir")
    stage(*args, "--resume", "--draft-intermediate-size", 1536)  # SmolLM2's own: the same draft


def test_packed_batches_match_speculators_collate(data_dir, hs_dir):
    """Our reader lays batches out exactly as speculators' shift_batch + CollateFn, including a pack
    cut at max_len; and our sync-free accuracy counts equal speculators'."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.metrics import compute_accuracy_single_step
    from speculators.train.data import CollateFn

    from common.draft import accuracy_counts
    from common.loader import PackedBatches, collect_rows
    manifest = read_json(hs_dir / "manifest.json")
    files, lengths, aux, _ = collect_rows([str(data_dir)], str(data_dir / "vocab_mapping"),
                                          manifest["inputs"]["verifier_hash"], manifest["hidden_size"])
    max_len = 300
    batches = [[0, 1, 2], [5], [7, 3, 9, 11, 4]]
    assert sum(lengths[i] for i in batches[2]) > max_len  # the last pack is cut
    ours = list(PackedBatches(files, lengths, len(aux), manifest["hidden_size"], max_len, torch.device("cpu"),
                              torch.float32, threads=2)(batches))
    collate = CollateFn(max_len, manifest["hidden_size"], len(aux), dtype=torch.float32)
    for rows, got in zip(batches, ours):
        items = []
        for i in rows:
            f = load_file(files[i])
            hs = f["hidden_states"]
            items.append(shift_batch({
                "hidden_states": hs[:, :-1].flatten(1), "verifier_last_hidden_states": hs[:, -1],
                "input_ids": f["token_ids"], "loss_mask": f["loss_mask"], "lengths": torch.tensor([hs.shape[0]]),
                "position_ids": torch.arange(hs.shape[0])}))
        want = collate(items)
        for key in ("hidden_states", "verifier_last_hidden_states", "input_ids", "loss_mask", "position_ids",
                    "document_ids"):
            assert torch.equal(got[key], want[key]), key
        assert got["tokens"] == int((want["document_ids"] >= 0).sum())
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randint(0, 3, (1, 200), generator=g), torch.randint(0, 3, (1, 200), generator=g)
    mask, prev = torch.rand(1, 200, generator=g) > 0.3, torch.rand(1, 200, generator=g) > 0.2
    want = compute_accuracy_single_step(pred, target, mask.long(), prev.clone())
    got = accuracy_counts(pred, target, mask.long(), prev.clone())
    assert [float(x) for x in got] == [float(x) for x in want]


def test_flex_block_mask_gives_the_dense_mask_forward(data_dir, hs_dir, verifier):
    """Flex attention's block mask (what --attn-impl auto takes for long packs on a GPU) computes what
    sdpa's dense TTT mask computes, on a pack of several conversations, at every TTT step. Forward only:
    torch has no flex attention backward on the CPU (04 says so in one line)."""
    from types import SimpleNamespace

    from speculators.losses import resolve_loss_config

    from common.draft import build_draft
    from common.loader import PackedBatches, collect_rows
    from common.train import forward
    manifest = read_json(hs_dir / "manifest.json")
    files, lengths, aux, _ = collect_rows([str(data_dir)], str(data_dir / "vocab_mapping"),
                                          manifest["inputs"]["verifier_hash"], manifest["hidden_size"])
    batch = next(iter(PackedBatches(files, lengths, len(aux), manifest["hidden_size"], 1024, torch.device("cpu"),
                                    torch.float32, threads=1)([[0, 1, 2, 3]])))
    assert len(set(batch["document_ids"].flatten().tolist()) - {-1}) >= 3 and batch["tokens"] < 1024  # padded too
    args = SimpleNamespace(noise_std=0, ttt_steps=3, ttt_loss_decay=1.0, dtype="float32")
    results = {}
    for attn in ("sdpa", "simple_flex_attention"):
        torch.manual_seed(0)
        model = build_draft(str(verifier), aux, str(data_dir / "vocab_mapping"), 3, attn)
        with torch.no_grad():
            results[attn] = forward(model, batch, args, resolve_loss_config("kl_div", "eager"), torch.device("cpu"), False)
    (dense_loss, dense), (flex_loss, flex) = results["sdpa"], results["simple_flex_attention"]
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-5, atol=1e-5)
    for key in dense:
        torch.testing.assert_close(flex[key], dense[key], rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.slow
def test_compiled_forward_trains_what_eager_trains(tmp_path, data_dir):
    """--compile --compile-wait (torch.compile of speculators' forward with our sync-free accuracy counts,
    before the first step) gives the eager losses and accuracies, traces the whole forward as one graph
    (no graph break, no recompile at each TTT step), and says in the log how long compiling took.
    Plain --compile starts with eager steps and switches to the compiled forward when it is built (the
    compiled run before it left inductor's cache warm, so that comes a few steps in)."""
    runs, logs, steps = {}, {}, 20
    for name, flags in [("eager", []), ("compiled", ["--compile", "--compile-wait"]), ("beside", ["--compile"])]:
        out = tmp_path / name
        proc = stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, "--max-steps", steps, "--log-every", 1,
                     "--val-ratio", 0, "--max-seq-len", 512, "--lr", 1e-3, "--dtype", "float32", "--optimizer", "adamw",
                     "--noise-std", 0, *flags,
                     env={"TORCH_LOGS": "graph_breaks,recompiles"})  # float32: bf16's rounding differs between the two
        runs[name], logs[name] = records(out, "train"), proc.stdout
        assert "Graph break" not in proc.stderr and "Recompiling" not in proc.stderr, proc.stderr[-3000:]
    took = r"compiled forward in use from step \d+: torch.compile took [\d.]+s \([\d.]+s tracing and compiling the forward, [\d.]+s the backward\)"
    assert "the first step waits for it" in logs["compiled"]
    assert logs["compiled"].index("compiled forward in use") < logs["compiled"].index("first step done")
    assert "beside eager steps until it is ready" in logs["beside"]
    assert logs["beside"].index("first step done") < logs["beside"].index("compiled forward in use")
    assert re.search(took, logs["compiled"]) and re.search(took, logs["beside"])
    assert int(re.search(r"in use from step (\d+)", logs["beside"]).group(1)) <= steps, "it switched during the run"
    assert "torch.compile failed" not in logs["compiled"] + logs["beside"]
    assert len(runs["compiled"]) == len(runs["eager"]) == steps
    for eager, compiled in zip(runs["eager"], runs["compiled"]):
        assert abs(eager["loss"] - compiled["loss"]) < 1e-3 * eager["loss"]
        assert all(abs(a - b) < 1e-3 for a, b in zip(eager["acc_pos"], compiled["acc_pos"]))
    assert [r["loss"] for r in runs["beside"]] == pytest.approx([r["loss"] for r in runs["eager"]], rel=1e-3)


def test_bf16_trains_what_float32_trains(tmp_path, data_dir):
    """--dtype bfloat16 (autocast over float32 weights: the default on a GPU and on a CPU with AMX) follows the
    float32 run's losses within bf16 rounding, and the log and run.json say which dtype ran; without the flag,
    04 takes common/verifier.py's compute_dtype for the device."""
    from common.verifier import compute_dtype
    runs, steps = {}, {"float32": 12, "bfloat16": 4, None: 2}  # bf16 is emulated, slowly, on a CPU without AMX
    for dtype in ("float32", "bfloat16", None):
        out = tmp_path / str(dtype)
        proc = stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, "--max-steps", steps[dtype],
                     "--log-every", 1,
                     "--val-ratio", 0, "--max-seq-len", 512, "--lr", 1e-3, "--optimizer", "adamw", "--noise-std", 0,
                     "--scheduler", "none", "--warmup-steps", 0,  # a flat lr: the short runs take the long one's steps
                     *(["--dtype", dtype] if dtype else []))
        ran = dtype or compute_dtype("cpu")
        assert f"device cpu x 1, {ran}" in proc.stdout
        assert read_json(out / "checkpoints" / "latest" / "run.json")["args"]["dtype"] == ran
        runs[dtype] = [r["loss"] for r in records(out, "train")]
    assert len(runs["float32"]) == steps["float32"] and runs["float32"][-1] < 0.8 * runs["float32"][0]
    assert runs["bfloat16"] == pytest.approx(runs["float32"][:steps["bfloat16"]], rel=0.02)
    assert runs["bfloat16"] != runs["float32"][:steps["bfloat16"]], "the bf16 run computed in float32"
    assert runs[None] == runs[compute_dtype("cpu")][:2]


@pytest.mark.slow
def test_training_under_a_memory_limit_cuts_packs_and_goes_on(tmp_path, data_dir):
    """04 under a host memory limit too small for its 8K-token packs: the step that runs out of memory is
    done again in parts cut at conversation boundaries, the log says so, and training goes on. The limit
    climbs a ladder (what a process needs differs between machines): the first limit that trains must
    be one where the packs were cut, since one that fits whole packs is above one that fits parts."""
    for gb in (2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 8.0):
        out = tmp_path / f"limit_{gb}"
        proc = stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, "--max-steps", 2, "--max-seq-len", 8192,
                     "--log-every", 1, "--val-ratio", 0, "--num-workers", 1, "--optimizer", "adamw", "--noise-std", 0,
                     check=False, memory_limit=int(gb * 2**30))
        if proc.returncode == 0:
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"out of memory on a \d+-token pack .*; training each pack in \d+ parts", proc.stdout), gb
    assert [r["step"] for r in records(out, "train")] == [1, 2]


def test_a_pack_cut_in_parts_gives_its_loss(data_dir, hs_dir, verifier):
    """The parts of a pack that ran out of memory, each loss weighted by its share of the loss-masked
    tokens, give the whole pack's loss (padded to flex attention's blocks too)."""
    from types import SimpleNamespace

    from speculators.losses import resolve_loss_config

    from common.draft import build_draft
    from common.loader import PackedBatches, collect_rows, split_pack
    from common.train import forward
    manifest = read_json(hs_dir / "manifest.json")
    files, lengths, aux, _ = collect_rows([str(data_dir)], str(data_dir / "vocab_mapping"),
                                          manifest["inputs"]["verifier_hash"], manifest["hidden_size"])
    batch = next(iter(PackedBatches(files, lengths, len(aux), manifest["hidden_size"], 2048, torch.device("cpu"),
                                    torch.float32, threads=1)([list(range(12))])))
    torch.manual_seed(0)
    model = build_draft(str(verifier), aux, str(data_dir / "vocab_mapping"), 3, "sdpa")
    args, loss_config = SimpleNamespace(noise_std=0, ttt_steps=3, ttt_loss_decay=1.0, dtype="float32"), resolve_loss_config("kl_div", "eager")
    with torch.no_grad():
        whole = float(forward(model, batch, args, loss_config, torch.device("cpu"), False)[0])
        for pieces, multiple in [(2, 1), (4, 1), (4, 128)]:
            parts = split_pack(batch, pieces, multiple)
            assert len(parts) == pieces and sum(p["tokens"] for p, _ in parts) == batch["tokens"]
            assert all(p["input_ids"].shape[1] % multiple == 0 for p, _ in parts)
            got = sum(w * float(forward(model, p, args, loss_config, torch.device("cpu"), False)[0]) for p, w in parts)
            assert got == pytest.approx(whole, rel=1e-5), (pieces, multiple)
    one = {k: v[:, :lengths[0]] if torch.is_tensor(v) else v for k, v in batch.items()}
    one["tokens"] = lengths[0]
    assert len(split_pack(one, 4)) == 1  # one conversation cannot be cut


def test_muon_trains_a_two_layer_wider_draft_with_its_two_optimizers(tmp_path, data_dir):
    from common.draft import load_draft
    out = tmp_path / "muon"
    stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, "--optimizer", "muon", "--max-steps", 8,
          "--lr", 2e-3, "--warmup-steps", 2, "--log-every", 2, "--num-workers", 1, "--max-seq-len", 1024,
          "--draft-layers", 2, "--draft-intermediate-size", 2048)
    state = torch.load(out / "checkpoints" / "latest" / "training_state.pt", weights_only=False)
    assert len(state["optimizer"]) == 2  # Muon over fc and the layers' matrices, AdamW over the norms
    assert len(state["optimizer"][0]["param_groups"][0]["params"]) >= 15  # fc + 7 matrices a layer
    assert read_json(out / "checkpoints" / "latest" / "config.json")["transformer_layer_config"]["num_hidden_layers"] == 2
    draft = load_draft(str(out / "checkpoints" / "latest"))
    assert len(draft.layers) == 2  # SmolLM2's MLP is 1,536 wide; the draft's is what the flag says
    assert all(layer.mlp.up_proj.weight.shape == (2048, 576) for layer in draft.layers)
    train = records(out, "train")
    assert train[-1]["loss"] < train[0]["loss"]


def test_noise_touches_training_rows_only(tmp_path, data_dir):
    runs = {}
    for noise in (0.0, 20.0):
        out = tmp_path / f"noise_{noise}"
        stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, "--max-steps", 1, "--lr", 1e-12,
              "--log-every", 1, "--num-workers", 0, "--val-ratio", 0.2, "--max-seq-len", 1024, "--noise-std", noise)
        runs[noise] = (records(out, "train")[0], records(out, "val")[0])
    (train_clean, val_clean), (train_noisy, val_noisy) = runs[0.0], runs[20.0]
    assert train_noisy["loss"] != train_clean["loss"]
    assert abs(val_noisy["loss"] - val_clean["loss"]) < 1e-6 * max(1.0, val_clean["loss"])


def test_bad_input_exits_2_with_one_line(tmp_path, data_dir, hs_dir, other_verifier):
    empty = tmp_path / "empty"
    empty.mkdir()
    stage("02_build_vocab_mapping.py", "--data-dir", data_dir, "--verifier-path", other_verifier,
          "--output-dir", tmp_path / "vm_other")
    cases = [
        (["--data-dir", data_dir, "--verifier-path", other_verifier,
          "--vocab-mapping-dir", tmp_path / "vm_other"], "another verifier"),
        (["--data-dir", data_dir, "--vocab-mapping-dir", tmp_path / "vm_other"], "49280"),
        (["--data-dir", empty, "--vocab-mapping-dir", data_dir / "vocab_mapping"], "no hidden_states"),
        (["--data-dir", data_dir, "--val-ratio", 0.999], "no training rows"),
        (["--data-dir", data_dir, "--scheduler", "step"], "invalid choice"),
        (["--data-dir", data_dir, "--compile-wait"], "add --compile"),
        (["--data-dir", data_dir, "--optimizer", "adamw", "--muon-lr", 1e-3], "add --optimizer muon"),
        (["--data-dir", data_dir, "--best-by", "bleu"], "invalid choice"),
        (["--data-dir", data_dir, "--max-steps", 0], "--max-steps"),
        (["--data-dir", data_dir, "--loss", "nonsense"], "unknown loss function"),
        (["--data-dir", data_dir, "--attn-impl", "simple_flex_attention"], "trains only on a GPU"),
        (["--data-dir", data_dir, "--draft-layers", 0], "--draft-layers: 0: must be at least 1"),
        (["--data-dir", data_dir, "--draft-intermediate-size", 0], "--draft-intermediate-size: 0: must be at least 1"),
        (["--data-dir", data_dir, "--grad-clip", -1], "--grad-clip: -1.0: must be a positive number"),
        (["--data-dir", data_dir, "--noise-std", "nan"], "--noise-std: nan: must be at least 0"),
        (["--data-dir", data_dir, "--warmup-ratio", 1.5], "--warmup-ratio: 1.5: must be in [0, 1]"),
        (["--data-dir", data_dir, "--weight-decay", -5], "--weight-decay: -5.0: must be at least 0"),
        (["--data-dir", data_dir, "--log-every", 0], "--log-every: 0: must be at least 1"),
    ]
    assert_bad_inputs("04_train.py", cases, lambda i: ["--max-steps", 1, "--output-dir", tmp_path / f"out{i}"])


def test_speculators_reads_the_exported_data_dir(tmp_path, data_dir, hs_dir):
    """export_speculators_data.py: speculators' own dataset class reads our rows and states as they are."""
    import numpy as np
    from speculators.train.data import ArrowDataset

    from common.data import load_prepared
    out = tmp_path / "spec"
    stage("export_speculators_data.py", "--data-dir", data_dir, "--output-dir", out)
    n = len(np.load(data_dir / "vocab_mapping" / "d2t.npy"))
    assert (out / f"d2t-{n}.npy").exists() and (out / f"t2d-{n}.npy").exists() and (out / "token_freq.pt").exists()
    dataset = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    prepared = load_prepared(str(data_dir / "prepared" / "rows_0-64"))
    assert len(dataset) == len(prepared)
    for i in (0, len(dataset) - 1):
        item = dataset[i]
        assert item["input_ids"].tolist() == prepared[i]["input_ids"]  # it returns SampleUnavailable on a mismatch
        assert item["loss_mask"].tolist() == prepared[i]["loss_mask"]
        assert item["hidden_states"].shape[-1] == 3 * read_json(hs_dir / "manifest.json")["hidden_size"]
    # two data dirs (original and regenerated rows, say) export as one, with the first one's vocab mapping
    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy, ignore=shutil.ignore_patterns("speculators", "logs", ".lock*"))
    stage("export_speculators_data.py", "--data-dir", data_dir, copy, "--output-dir", tmp_path / "both")
    both = ArrowDataset(max_len=4096, datapath=str(tmp_path / "both"), on_missing="raise")
    assert len(both) == 2 * len(prepared)
    assert both[len(prepared)]["input_ids"].tolist() == prepared[0]["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("val_ratio", [0.0, 0.01, 0.25])  # no validation row, one (fewer than ranks), sixteen
def test_torchrun_two_processes_validate_all_rows_as_one_process(tmp_path, data_dir, val_ratio):
    """torchrun --nproc-per-node 2 (gloo, the CPU): validation is reduced over the ranks, so at the same weights
    (a learning rate of 1e-12) it gives one process's figures on any number of rows; rank 0 alone writes the
    metrics and the one summary line, whose best estimate is a number."""
    common = ["04_train.py", "--data-dir", data_dir, "--max-steps", 2, "--lr", 1e-12, "--max-seq-len", 1024,
              "--num-workers", 1, "--val-ratio", val_ratio]
    runs = {}
    for name, prefix in [("one", []), ("two", ["-m", "torch.distributed.run", "--nproc-per-node", 2])]:
        out = tmp_path / name
        if name == "one" and not val_ratio:
            continue
        proc = subprocess.run([sys.executable, *map(str, prefix), os.path.join(ROOT, common[0]), *map(str, common[1:]),
                               "--output-dir", str(out)], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summaries = [line for line in proc.stdout.splitlines() if "done in" in line]
        assert len(summaries) == 1 and "-inf" not in summaries[0], summaries
        assert ("no validation split" in summaries[0]) == (not val_ratio)
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                      if '"val"' in line]
        assert (out / "checkpoints" / "best" / "model.safetensors").exists() or not val_ratio
    if val_ratio:
        assert len(runs["one"]) == len(runs["two"]) == 1
        one, two = runs["one"][0], runs["two"][0]
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-4)
        assert two["acc_pos"] == pytest.approx(one["acc_pos"], abs=1e-4)


def test_muon_float32_orthogonalization_is_torchs_within_bfloat16():
    """On CPUs that emulate bfloat16, Muon orthogonalizes in float32: the same iteration as torch's."""
    import torch.optim._muon as muon
    from common.train import orthogonalize_float32
    coefficients = (3.4445, -4.775, 2.0315)
    for shape in [(96, 200), (200, 96)]:
        grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        ours = orthogonalize_float32(grad, coefficients, 5, 1e-7)
        torchs = muon._zeropower_via_newtonschulz(grad, coefficients, 5, 1e-7).float()  # noqa: SLF001
        assert ours.dtype == torch.float32 and ours.shape == grad.shape
        assert (ours - torchs).abs().max() < 0.03 * torchs.abs().max()


@pytest.fixture(scope="module")
def states_server(data_dir):
    """serve_states.py on the CPU (float32, as the fixture's 03 ran), for the tests of 04 --states-from server."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "serve_states.py"), "--port", str(port), "--dtype",
                             "float32", "--max-model-len", "512"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("STATES_URL="):
            break
    assert proc.poll() is None, "".join(lines[-30:])
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # its log must not fill the pipe
    yield line.strip().split("=", 1)[1]
    proc.terminate()
    proc.wait(timeout=120)


STATES_ARGS = ["--log-every", 1, "--val-ratio", 0.1, "--max-seq-len", 512, "--lr", 1e-3, "--dtype", "float32",
               "--optimizer", "adamw", "--noise-std", 0, "--num-workers", 2,
               "--scheduler", "none", "--warmup-steps", 0]  # a flat lr: --max-steps 3 then 6 is one schedule


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory, data_dir):
    """6 steps on 03's files: what the runs fed by computed states must give."""
    out = tmp_path_factory.mktemp("disk_run")
    stage("04_train.py", "--data-dir", data_dir, *STATES_ARGS, "--output-dir", out, "--max-steps", 6)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("source", ["colocated", "server"])
def test_states_computed_while_training_give_disks_losses_and_resume(tmp_path, data_dir, disk_run, source, request):
    """--states-from colocated (the verifier in the training process) and server (a vLLM server started by
    serve_states.py) compute each pack's states from 01's rows and give the losses of 03's files on the same rows
    and seed (float32 everywhere, the states rounded to bf16 as 03 stores them; vLLM's own kernels differ from
    transformers' within that), say so in the log and run.json, report the share of time the loop waited for states,
    and resume: 3 steps, then --resume to 6, are the disk run's 6 steps."""
    flags = ["--states-from", source] + (["--states-url", request.getfixturevalue("states_server")]
                                         if source == "server" else [])
    common = ["--data-dir", data_dir, *STATES_ARGS]
    proc = stage("04_train.py", *common, "--output-dir", tmp_path / source, "--max-steps", 3, *flags)
    assert f"states from {source}" in proc.stdout and re.search(r"waited for states \d+%", proc.stdout)
    stage("04_train.py", *common, "--output-dir", tmp_path / source, "--max-steps", 6, *flags, "--resume")
    disk, computed = records(disk_run, "train"), records(tmp_path / source, "train")
    tolerance = 1e-5 if source == "colocated" else 1e-3
    assert [r["step"] for r in computed] == list(range(1, 7))
    assert [r["loss"] for r in computed] == pytest.approx([r["loss"] for r in disk], rel=tolerance)
    assert records(tmp_path / source, "val")[-1]["loss"] == pytest.approx(records(disk_run, "val")[-1]["loss"],
                                                                          rel=tolerance)
    assert all(0 <= r["states_wait_share"] <= 1 for r in computed)
    assert read_json(tmp_path / source / "checkpoints" / "latest" / "run.json")["args"]["states_from"] == source


@pytest.mark.slow
def test_a_states_server_that_is_down_or_stores_other_layers_is_one_line(tmp_path, data_dir, states_server, verifier):
    from safetensors.torch import save_file
    # another verifier with the same tokenizer and widths (a fine-tune of it, say): here its final norm scaled
    other = tmp_path / "other_verifier"
    other.mkdir()
    for name in os.listdir(verifier):
        if name != "model.safetensors":
            os.symlink(os.path.join(verifier, name), other / name)
    weights = load_file(os.path.join(verifier, "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    common = ["04_train.py", "--data-dir", data_dir, "--output-dir", tmp_path / "out", "--max-steps", 1]
    cases = [(["--states-from", "server", "--states-url", "http://127.0.0.1:9"], "no vLLM server answers"),
             (["--states-from", "server", "--states-url", states_server, "--layers", 3, 10, 20],
              "stores layers [2, 15, 27, 30], this run trains on [3, 10, 20, 30]"),
             (["--states-from", "server", "--states-url", states_server, "--verifier-path", other],
              "it serves another verifier"),
             (["--states-url", states_server], "--states-from server needs --states-url"),
             (["--layers", 3, 10, 20], "--layers chooses the layers colocated and server sources compute")]
    for flags, words in cases:
        assert_user_error(stage(*common, *flags, check=False), words)
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.slow
def test_on_policy_rows_hold_the_servers_replies_masked_and_their_states(tmp_path, data_dir, prepared_dir, verifier,
                                                                        tokenizer, states_server):
    """--on-policy: the server writes every reply of a row anew (greedy, at most as long as the row's), each request
    keeping the states of its generated tokens (include_output_tokens). The new row keeps the row's prompt and user
    turns in place, its loss mask is 1 on the generated tokens only, its first reply is the verifier's greedy
    continuation (transformers, float32, as the server runs here), and its states are the ones the server computes
    for the new row sent as a prompt. 04 trains two steps on such rows and records the option."""
    from transformers import AutoModelForCausalLM
    from common.data import load_prepared
    from common.states_server import StatesClient, runs_of_ones
    client = StatesClient(states_server, tokenizer, [2, 15, 27, 30], 576)
    rows = load_prepared(str(prepared_dir))
    multi = [i for i, m in enumerate(rows["loss_mask"]) if len(runs_of_ones(m)) >= 2]
    assert multi, "the fixture's rows hold no conversation of two replies"
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32)
    for i in [0, *multi[:2]]:
        ids, mask = rows["input_ids"][i], rows["loss_mask"][i]
        new_ids, new_mask, states = client.on_policy(ids, mask)
        old, new = runs_of_ones(mask), runs_of_ones(new_mask)
        assert len(new_ids) == len(new_mask) == states.shape[0] <= len(ids) and states.shape[1:] == (4, 576)
        assert 1 <= len(new) <= len(old) and sum(new_mask) > 0
        assert new_ids != ids  # replies the verifier wrote, not ShareGPT's
        # what is not a reply is the row's: the prompt, and each user turn between replies, in order
        gaps = lambda t, spans: [t[(spans[k - 1][1] if k else 0):a] for k, (a, _) in enumerate(spans)]  # noqa: E731
        assert gaps(new_ids, new) == gaps(ids, old)[:len(new)]
        start, end = new[0]
        want = model.generate(torch.tensor([ids[:start]]), max_new_tokens=24, do_sample=False)[0, start:].tolist()
        n = min(len(want), end - start)  # (the row's last token, its final reply's, is left out)
        assert new_ids[start:start + n] == want[:n]
        torch.testing.assert_close(states.float(), client.states(new_ids).float(), rtol=1e-3, atol=1e-3)
    out = tmp_path / "on_policy"
    proc = stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, "--max-steps", 2, "--log-every", 1,
                 "--max-seq-len", 512, "--dtype", "float32", "--num-workers", 2, "--val-ratio", 0.05,
                 "--states-from", "server", "--states-url", states_server, "--on-policy")
    assert "--on-policy" in proc.stdout and len(records(out, "train")) == 2
    assert read_json(out / "checkpoints" / "latest" / "run.json")["args"]["on_policy"] is True


@pytest.mark.slow
def test_torchrun_two_processes_train_as_one_with_the_same_global_batch_and_resume(tmp_path, data_dir, states_server):
    """torchrun --nproc-per-node 2 (gloo, the CPU) trains what one process trains with --grad-accum 2: each rank
    takes the packs one process accumulates, DDP averages what accumulation averages. Two steps, then --resume to
    four, under torchrun: the same weights and validation as one process's four steps, one checkpoint per save.
    Two ranks fed by a states server train the two steps the disk-fed ranks trained."""
    common = ["--data-dir", data_dir, "--max-seq-len", 512, "--lr", 1e-3, "--optimizer", "adamw", "--noise-std", 0,
              "--dtype", "float32", "--val-ratio", 0.1, "--num-workers", 1, "--scheduler", "none", "--warmup-steps", 0,
              "--log-every", 1]
    stage("04_train.py", *common, "--output-dir", tmp_path / "one", "--max-steps", 4, "--grad-accum", 2)
    server = ["--states-from", "server", "--states-url", states_server]
    for out, steps, more in (("two", 2, []), ("two", 4, ["--resume"]), ("server", 2, server)):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               os.path.join(ROOT, "04_train.py"), *map(str, common), "--output-dir", str(tmp_path / out),
                               "--max-steps", str(steps), *more], capture_output=True, text=True, timeout=1200,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    disk, served = (torch.load(tmp_path / o / "checkpoints" / "step_2" / "training_state.pt", weights_only=False)
                    for o in ("two", "server"))
    assert served["val"]["loss"] == pytest.approx(disk["val"]["loss"], rel=1e-3)  # the states' bf16 rounding
    assert [r["loss"] for r in records(tmp_path / "server", "train")] == pytest.approx(
        [r["loss"] for r in records(tmp_path / "two", "train")][:2], rel=1e-3)
    one = torch.load(tmp_path / "one" / "checkpoints" / "step_4" / "training_state.pt", weights_only=False)
    two = torch.load(tmp_path / "two" / "checkpoints" / "step_4" / "training_state.pt", weights_only=False)
    assert one["step"] == two["step"] == 4
    for name in one["model"]:
        torch.testing.assert_close(two["model"][name], one["model"][name], rtol=1e-4, atol=1e-5)
    assert two["val"]["loss"] == pytest.approx(one["val"]["loss"], rel=1e-4)
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["best", "latest", "step_2", "step_4"]
