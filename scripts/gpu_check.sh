#!/usr/bin/env bash
# One GPU's check of the CUDA paths (its output, from one NVIDIA H200: docs/gpu/): `generate --device cuda --tp 1`
# eager and --compile, then scripts/compiled_decode_bench.py on the toy and full-width dirs. Needs torch (CUDA),
# transformers, DeepSpeed and codegen importable by python3; where a `.whl` dir holds them as wheels (and
# DeepSpeed's sdist) for a machine with no index, they are installed from it first. With one GPU the tensor-parallel
# group is one rank (NCCL takes one rank per GPU): the reductions are not exercised, the CUDA paths are.
# DEVICE=cpu SIZE=tiny PY=.venv/bin/python runs the same on the CPU, to try it before a GPU lease; FAMILIES (if set)
# names the toy decode bench's families, in place of that script's default.
set -u
DEVICE=${DEVICE:-cuda}; SIZE=${SIZE:-bench}; OUT=${OUT:-/tmp/codegen-gpu-check}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
if [[ $DEVICE == cuda && -d .whl ]]; then
    t0=$SECONDS
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -3
    $PY -m pip wheel -q --no-deps --no-build-isolation --no-index -w /tmp/dsw .whl/deepspeed-*.tar.gz 2>&1 | tail -3
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/dsw/*.whl 2>&1 | grep -v WARN | tail -3
    export PYTHONPATH=/tmp/site:$PWD
    echo "install: $((SECONDS - t0)) s"
fi
[[ $DEVICE == cuda ]] && nvidia-smi -L
$PY -c "import torch, transformers, deepspeed, libcst; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -1
W="$OUT/work"; rm -rf "$W"; mkdir -p "$W"
t0=$SECONDS
$PY -c "
import sys; from pathlib import Path
from codegen.harness.examples import build_example, build_tokenizer
work, size, device = sys.argv[1:]
d = Path(work) / 'qwen3_moe'
build_example('qwen3_moe', d, size=size, dtype='bfloat16' if device == 'cuda' else 'float32'); build_tokenizer(d)
" "$W" "$SIZE" "$DEVICE" 2>&1 | tail -2
$PY -m codegen patch "$W/qwen3_moe" 2>&1 | tail -1
echo "build+patch: $((SECONDS - t0)) s"
t0=$SECONDS
timeout 90 $PY -m codegen generate "$W/qwen3_moe" --tp 1 --device $DEVICE --max-tokens 12 --json --prompt "The capital of France is" > $OUT/generate-eager.log 2>&1
echo "generate: rc=$? $((SECONDS - t0)) s"; tail -3 $OUT/generate-eager.log
t0=$SECONDS
timeout 150 $PY -m codegen generate "$W/qwen3_moe" --tp 1 --device $DEVICE --compile --max-tokens 12 --json --prompt "The capital of France is" > $OUT/generate.log 2>&1
echo "generate --compile: rc=$? $((SECONDS - t0)) s"; tail -3 $OUT/generate.log
t0=$SECONDS
timeout 300 $PY scripts/compiled_decode_bench.py --device $DEVICE ${FAMILIES:+--families $FAMILIES} --size $SIZE --json $OUT/decode-$SIZE.json 2>&1 | tee $OUT/decode-$SIZE.raw.log | grep -v -i "warn\|output = func\|Loading weights\|Writing model" | tee $OUT/decode-$SIZE.log
echo "decode bench: $((SECONDS - t0)) s"
if [[ $DEVICE == cuda ]]; then
    t0=$SECONDS
    timeout 330 $PY scripts/compiled_decode_bench.py --device cuda --families qwen3_moe --size full --json $OUT/decode-full.json 2>&1 | tee $OUT/decode-full.raw.log | grep -v -i "warn\|output = func\|Loading weights\|Writing model" | tee $OUT/decode-full.log
    echo "decode bench full: $((SECONDS - t0)) s"
fi
