"""recipes/h200_full_size.sh's wiring, with every stage replaced by `echo` (PY=echo): which rows each training gets.
The stages themselves are tested in the other files; the recipe runs only on a GPU machine."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe(work, *made, **env):
    """Run the recipe in `work` with the prepared folders `made` (as 01 would leave them) already there; the 04
    command of each training it started, by name."""
    for folder in made:
        os.makedirs(work / folder / "prepared" / "rows_0-2")
    # PATH alone of the caller's environment: the recipe reads many variables
    env = dict(PATH=os.environ["PATH"], W=str(work), PY="echo", N="8", RSHARD="2", SELF_SHARD="2", A="0", B="0",
               C="0", **{k: str(v) for k, v in env.items()})
    out = subprocess.run(["bash", "recipes/h200_full_size.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "all done" in out.stdout, out.stdout + out.stderr
    return {f[3:-4]: (work / "logs" / f).read_text() for f in os.listdir(work / "logs")
            if f.startswith("04_") and f.endswith(".out")}


@pytest.mark.parametrize("regen, self_written, data", [
    (False, True, "orig self"),           # the self-written lever alone (s16)
    (True, False, "orig regen"),          # on-policy replies (s10, s11, s15)
    (True, True, "orig regen self"),
    (False, False, None),                 # nothing to add: no d
])
def test_d_trains_on_the_original_rows_with_the_regenerated_and_self_written_ones_there_are(
        tmp_path, regen, self_written, data):
    made = ["regen"] * regen + ["self"] * self_written
    runs = recipe(tmp_path, *made, REGEN_S=1, NREGEN=4 * regen, SELF=4 * self_written, D_EPOCHS=2)
    if data is None:
        assert "d" not in runs
        return
    expected = " ".join(str(tmp_path / d) for d in data.split())
    assert f"--epochs 2 --compile-wait --save-every 3000 --data-dir {expected} --vocab-mapping-dir " \
           f"{tmp_path}/orig/vocab_mapping" in runs["d"]


@pytest.mark.parametrize("env", [dict(SELF=4, REGEN_S=0), dict(SELF=4, REGEN_S=1, ORIG=0)])
def test_self_written_conversations_no_training_would_use_are_refused_with_one_line(tmp_path, env):
    out = subprocess.run(["bash", "recipes/h200_full_size.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=dict(PATH=os.environ["PATH"], W=str(tmp_path), PY="echo", **{k: str(v) for k, v in env.items()}))
    assert out.returncode == 2 and out.stderr.startswith("SELF: ") and out.stderr.count("\n") == 1, out.stderr
