"""Moved data and stale artifacts: a data dir copied elsewhere still trains on its own rows; a rerun of
01 makes the states downstream stale, which 04 refuses (naming 03) and 03 redoes."""
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import (DRAFT_VOCAB, HANG_GUARD_S, ROOT, ROWS, SEQ, assert_user_error, kill, read_json, records, stage,
                      start_stage)

QUICK_TRAIN = ["--max-steps", 2, "--max-seq-len", 1024, "--num-workers", 1, "--val-ratio", 0.1]


def test_copied_data_dir_trains_and_a_rerun_of_01_makes_its_states_stale(tmp_path, data_dir):
    copy = tmp_path / "moved" / "data"
    shutil.copytree(data_dir, copy, symlinks=True)
    stage("04_train.py", "--data-dir", copy, "--output-dir", tmp_path / "out1", *QUICK_TRAIN)
    hs = copy / "hidden_states" / f"rows_0-{ROWS}"
    assert not os.path.isabs(read_json(hs / "manifest.json")["inputs"]["prepared_dir"])

    # 01 again with the same flags: the same rows, so the states and the mapping stay valid
    stage("01_prepare_dataset.py", "--data-dir", copy, "--num-samples", ROWS, "--max-seq-len", SEQ)
    assert "rows already done, 0 to do" in stage("03_extract_hidden_states.py", "--data-dir", copy).stdout

    # 01 again with another --max-seq-len: other rows under the same name
    stage("01_prepare_dataset.py", "--data-dir", copy, "--num-samples", ROWS, "--max-seq-len", SEQ // 2)
    assert_user_error(stage("04_train.py", "--data-dir", copy, "--output-dir", tmp_path / "out2", *QUICK_TRAIN,
                            check=False), "03_extract_hidden_states.py", "rerun")
    assert_user_error(stage("export_speculators_data.py", "--data-dir", copy, check=False),
                      "03_extract_hidden_states.py")
    # 03 notices and extracts every row again, leaving no file of the old rows behind
    log = stage("03_extract_hidden_states.py", "--data-dir", copy, "--max-tokens-per-batch", 2048).stdout
    assert "extracting every row again" in log
    rows = read_json(copy / "prepared" / f"rows_0-{ROWS}" / "manifest.json")["counts"]["rows"]
    assert sorted(os.listdir(hs)) == sorted([f"hs_{i}.safetensors" for i in range(rows)]
                                            + ["manifest.json", "extract_config.json"])
    assert read_json(hs / "manifest.json")["counts"]["extracted"] == rows
    assert_user_error(stage("04_train.py", "--data-dir", copy, "--output-dir", tmp_path / "out2", *QUICK_TRAIN,
                            check=False), "built from other rows", "rerun 02_build_vocab_mapping.py")
    stage("02_build_vocab_mapping.py", "--data-dir", copy, "--draft-vocab-size", DRAFT_VOCAB)
    stage("04_train.py", "--data-dir", copy, "--output-dir", tmp_path / "out2", *QUICK_TRAIN)

    # 01 rewrites the rows while 03 extracts them (03 paused midway): 03 stops with a line, leaving no manifest
    stage("01_prepare_dataset.py", "--data-dir", copy, "--num-samples", ROWS, "--max-seq-len", SEQ)
    extract = start_stage("03_extract_hidden_states.py", "--data-dir", copy, "--max-tokens-per-batch", 512)
    log, deadline = copy / "logs" / "03_extract_hidden_states.log", time.time() + HANG_GUARD_S
    planned = log.read_text().count("to do (")
    while log.read_text().count("to do (") == planned:  # until this run has read the rows it extracts
        assert extract.poll() is None and time.time() < deadline, extract.communicate()
        time.sleep(0.05)
    extract.send_signal(signal.SIGSTOP)
    try:
        stage("01_prepare_dataset.py", "--data-dir", copy, "--num-samples", ROWS, "--max-seq-len", SEQ // 2)
    finally:
        extract.send_signal(signal.SIGCONT)
    _, stderr = extract.communicate(timeout=HANG_GUARD_S)
    assert extract.returncode == 2 and "was rewritten" in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert not (hs / "manifest.json").exists()


@pytest.mark.parametrize("damage", ["truncated", "zeros", "missing"])
def test_damaged_states_file_stops_04_before_training(tmp_path, data_dir, damage):
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy, symlinks=True)
    victim = copy / "hidden_states" / f"rows_0-{ROWS}" / "hs_5.safetensors"
    size = victim.stat().st_size
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:size // 2])
    elif damage == "zeros":
        victim.write_bytes(bytes(size))
    else:
        victim.unlink()
    proc = stage("04_train.py", "--data-dir", copy, "--output-dir", tmp_path / "out", *QUICK_TRAIN, check=False)
    assert_user_error(proc, "hs_5.safetensors", "03_extract_hidden_states.py")
    assert not (tmp_path / "out" / "checkpoints").exists()
    proc = stage("export_speculators_data.py", "--data-dir", copy, check=False)  # which checks the same
    assert_user_error(proc, "hs_5.safetensors", "03_extract_hidden_states.py")
    assert not (copy / "speculators").exists()


def test_one_run_writes_a_folder_and_a_dead_runs_lock_is_taken_over(tmp_path, data_dir):
    out = tmp_path / "out"
    first = start_stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, "--max-steps", 1000,
                        "--max-seq-len", 1024, "--num-workers", 1, quiet=True)
    try:
        deadline = time.time() + HANG_GUARD_S
        while not (out / ".lock").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        second = stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, "--resume", *QUICK_TRAIN, check=False)
        assert_user_error(second, "being written by another run", f"pid {first.pid}")
    finally:
        kill(first)
        first.wait()
    log = stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, "--resume", *QUICK_TRAIN).stdout
    assert f"taking over the lock of a run that ended without releasing it (pid {first.pid}" in log
    assert not (out / ".lock").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # a scheduler or kill; a dropped ssh session
def test_sigterm_saves_a_checkpoint_and_the_named_command_resumes(tmp_path, data_dir, sig):
    out = tmp_path / "out"
    proc = start_stage("04_train.py", "--data-dir", data_dir, "--output-dir", out, "--max-steps", 12, "--max-seq-len", 512,
                       "--num-workers", 1, "--log-every", 1, "--val-ratio", 0.1)
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.1)
    kill(proc, sig)
    stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 128 + sig, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    name = signal.Signals(sig).name
    assert len(errors) == 1 and f"stopped by {name}" in errors[0] and "Traceback" not in stderr
    assert f"stopped by {name}" in (out / "logs" / "04_train.log").read_text()  # where a dropped session can read it
    assert (out / "checkpoints" / "latest").exists()
    command = shlex.split(errors[0].split("resume with: ")[1])
    assert command[0] == sys.executable and command[-1] == "--resume"
    script = os.path.relpath(command[1], ROOT)  # the named command, run as stage() runs one
    stage(script, *command[2:])
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"train"' in line]
    assert steps == list(range(1, 13))  # each step once, the replayed ones too
    again = stage(script, *command[2:])
    assert "already finished at step 12" in again.stdout + again.stderr
    assert metrics.read_text().count('"train"') == 12


def test_resume_is_the_same_run_and_finds_its_checkpoints(tmp_path, data_dir):
    """--resume refuses a setting that changes what the run computes (naming it), applies one that may change
    (the lr), and never starts over on top of checkpoints: a missing `latest` resumes from the newest
    checkpoint, a damaged newest one falls back to the one before, a torn metrics line is dropped."""
    import numpy as np
    import torch
    out = tmp_path / "out"
    run = ["--data-dir", data_dir, "--output-dir", out, "--max-seq-len", 512, "--num-workers", 1, "--val-ratio", 0,
           "--log-every", 1, "--save-every", 1, "--lr", 3e-4]
    stage("04_train.py", *run, "--max-steps", 2)
    assert_user_error(stage("04_train.py", *run, "--resume", "--max-steps", 3, "--grad-accum", 2, check=False),
                      "--grad-accum 1 (this run: 2)", "new --output-dir")
    # another mapping of the same size: one draft token swapped for another verifier token
    other = tmp_path / "vm_other"
    shutil.copytree(data_dir / "vocab_mapping", other)
    t2d = np.load(other / "t2d.npy")
    t2d[np.flatnonzero(t2d)[-1]], t2d[np.flatnonzero(~t2d)[0]] = False, True
    np.save(other / "t2d.npy", t2d)
    np.save(other / "d2t.npy", np.flatnonzero(t2d) - np.arange(t2d.sum()))
    assert_user_error(stage("04_train.py", *run, "--resume", "--max-steps", 3, "--vocab-mapping-dir", other, check=False),
                      "another vocab mapping")
    log = stage("04_train.py", *run, "--resume", "--max-steps", 3, "--lr", 5e-3).stdout
    assert "resumed with changed flags" in log and "--lr 0.0003 -> 0.005" in log
    assert records(out, "train")[-1]["step"] == 3 and records(out, "train")[-1]["lr"] > 3e-4  # the new peak, scaled by the schedule

    (out / "checkpoints" / "latest").unlink()  # as after `rsync -r` without -l
    assert_user_error(stage("04_train.py", *run, "--max-steps", 4, check=False), "step_3", "--resume")
    log = stage("04_train.py", *run, "--resume", "--max-steps", 4).stdout
    assert "latest is missing" in log and f"resumed from {os.path.realpath(out / 'checkpoints' / 'step_3')}" in log

    state = out / "checkpoints" / "step_4" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:state.stat().st_size // 2])
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"split": "train", "st')  # a write cut short
    log = stage("04_train.py", *run, "--resume", "--max-steps", 5).stdout
    assert "the newer step_4" in log and f"resumed from {os.path.realpath(out / 'checkpoints' / 'step_3')}" in log
    assert "metrics.jsonl line" in log and "dropped" in log
    assert [r["step"] for r in records(out, "train")] == [1, 2, 3, 4, 5]  # step 4 once: its replay replaced the first
    assert torch.load(out / "checkpoints" / "latest" / "training_state.pt", weights_only=False)["step"] == 5

    (out / "checkpoints" / "latest").unlink()
    (out / "checkpoints" / "latest").symlink_to("step_9")  # a link to a folder someone deleted
    log = stage("04_train.py", *run, "--resume", "--max-steps", 6).stdout
    assert "a link to a missing folder" in log and f"resumed from {os.path.realpath(out / 'checkpoints' / 'step_5')}" in log


@contextlib.contextmanager
def small_disk(path, mib: int):
    """A real filesystem of `mib` MiB (tmpfs; mounting needs root, as CI has)."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield lambda options: subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_is_one_line_and_the_rerun_completes_identically(tmp_path, data_dir, hs_dir):
    """03 and 04 meet a full disk (03 writing states, 04 saving its second checkpoint): one line naming the
    folder, no part-file left taking the space, what was finished kept; once there is space, the same command
    (04: with --resume) ends where an uninterrupted run ends, file for file and weight for weight."""
    import torch
    with small_disk(tmp_path / "disk", 8) as remount:
        data = tmp_path / "disk" / "data"
        shutil.copytree(data_dir / "prepared", data / "prepared")
        extract = ["03_extract_hidden_states.py", "--data-dir", data, "--max-tokens-per-batch", 2048, "--dtype", "float32"]
        proc = stage(*extract, "--force", check=False)  # --force: past the free-space check before extraction
        assert_user_error(proc, f"the disk holding {data} is full", "rerun")
        hs = data / "hidden_states" / hs_dir.name
        assert list(hs.glob("hs_*.safetensors")) and not list(data.rglob("*.tmp*"))  # finished rows kept, no part
        remount("size=200m")
        stage(*extract)
        for reference in hs_dir.glob("hs_*.safetensors"):
            assert (hs / reference.name).read_bytes() == reference.read_bytes(), reference.name

    train = ["--data-dir", data_dir, "--max-steps", 2, "--save-every", 1, "--max-seq-len", 512, "--val-ratio", 0,
             "--num-workers", 1]
    with small_disk(tmp_path / "disk2", 200) as remount:  # room for one checkpoint (~130 MB), not two
        out = tmp_path / "disk2" / "out"
        assert_user_error(stage("04_train.py", *train, "--output-dir", out, check=False),
                          f"the disk holding {out / 'checkpoints'} is full", "saving step_2", "--resume")
        assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_1"]  # the one before, intact
        remount("size=400m")
        stage("04_train.py", *train, "--output-dir", out, "--resume")
        stage("04_train.py", *train, "--output-dir", tmp_path / "reference")
        resumed, reference = (torch.load(o / "checkpoints" / "latest" / "training_state.pt", weights_only=False)
                              for o in (out, tmp_path / "reference"))
        assert resumed["step"] == reference["step"] == 2
        for name in reference["model"]:
            torch.testing.assert_close(resumed["model"][name], reference["model"][name], rtol=1e-5, atol=1e-6)


def test_a_read_only_output_is_one_line(tmp_path, data_dir):
    with small_disk(tmp_path / "ro", 64) as remount:
        shutil.copytree(data_dir / "prepared", tmp_path / "ro" / "data" / "prepared")
        remount("ro")
        for script, args in [("03_extract_hidden_states.py", ["--data-dir", tmp_path / "ro" / "data"]),
                             ("04_train.py", ["--data-dir", data_dir, "--output-dir", tmp_path / "ro" / "out"])]:
            assert_user_error(stage(script, *args, check=False), str(tmp_path / "ro"), "read-only file system")


def test_a_verifier_with_missing_weights_is_refused(tmp_path, data_dir, other_verifier):
    """A load that reports missing weights would extract states with random layers: one line naming them."""
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "broken_verifier"
    shutil.copytree(other_verifier, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(data_dir / "prepared", tmp_path / "data" / "prepared")
    proc = stage("03_extract_hidden_states.py", "--data-dir", tmp_path / "data", "--verifier-path", broken, check=False)
    assert_user_error(proc, "decoder layer 1", "mlp.down_proj.weight", "damaged")
    assert not list((tmp_path / "data" / "hidden_states").glob("*/hs_*.safetensors"))


def test_cut_off_prepared_rows_are_one_line_naming_01(tmp_path, data_dir):
    copy = tmp_path / "data"
    shutil.copytree(data_dir / "prepared", copy / "prepared")
    arrow = next((copy / "prepared" / f"rows_0-{ROWS}").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:arrow.stat().st_size // 2])
    proc = stage("02_build_vocab_mapping.py", "--data-dir", copy, check=False)
    assert_user_error(proc, f"rows_0-{ROWS}", "damaged", "01_prepare_dataset.py")


def test_an_output_path_that_is_a_file_is_one_line(tmp_path, data_dir):
    blocker = tmp_path / "out"
    blocker.write_text("not a folder")
    proc = stage("04_train.py", "--data-dir", data_dir, "--output-dir", blocker, *QUICK_TRAIN, check=False)
    assert_user_error(proc, str(blocker), "a file is in the way")


def test_overlapping_shards_are_refused(tmp_path, data_dir):
    """01 --num-samples 20 beside rows_0-64 makes rows_0-20: the same conversations twice."""
    copy = tmp_path / "data"
    shutil.copytree(data_dir / "prepared", copy / "prepared")
    stage("01_prepare_dataset.py", "--data-dir", copy, "--num-samples", 20, "--max-seq-len", SEQ)
    proc = stage("02_build_vocab_mapping.py", "--data-dir", copy, check=False)
    assert_user_error(proc, "rows_0-20", f"rows_0-{ROWS}", "overlap")


def test_02_05_and_the_export_refuse_a_folder_another_run_writes(tmp_path, data_dir):
    """The lock 01, 03 and 04 take, in the stages that write a vocab mapping, a report and an export."""
    from common.manifest import output_lock
    out = tmp_path / "out"
    for script, args, folder, name in [
            ("02_build_vocab_mapping.py", ["--output-dir", out / "vm"], out, ".lock.vm"),
            ("export_speculators_data.py", ["--output-dir", out / "spec"], out, ".lock.spec"),
            ("05_evaluate.py", ["--output-dir", out, "--draft-path", out], out / "eval", ".lock")]:
        with output_lock(str(folder), name):  # held by this process, as a running stage holds it
            proc = stage(script, "--data-dir", data_dir, *args, check=False)
        assert_user_error(proc, "being written by another run", f"pid {os.getpid()}")


def test_sigterm_stops_01_with_a_line_and_nothing_complete_looking(tmp_path):
    proc = start_stage("01_prepare_dataset.py", "--data-dir", tmp_path, "--num-samples", 400, "--max-seq-len", SEQ)
    log = tmp_path / "logs" / "01_prepare_dataset.log"
    while proc.poll() is None and not (log.exists() and "preparing rows" in log.read_text()):
        time.sleep(0.1)
    kill(proc, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr
    assert "stopped by SIGTERM" in stderr and "stopped by SIGTERM" in log.read_text()
    assert not list(tmp_path.glob("prepared/*/manifest.json"))
