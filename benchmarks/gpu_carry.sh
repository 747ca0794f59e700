#!/usr/bin/env bash
# Carries benchmarks/gpu_check.py to a bare GPU machine of the workplace image (torch,
# transformers, numpy, tokenizers, safetensors and jinja2 already there; no network).
#
#   bash benchmarks/gpu_carry.sh        here: build .gpu-carry/ (git-ignored, ~7 MB): the
#                                       bundled tokenizer's files and the wheels below
#   bash benchmarks/gpu_carry.sh run    there, from the repository root, with .gpu-carry
#                                       carried: install the wheels into /tmp/site, run every
#                                       check, and keep the log in $OUT (when set)
#
# The engine's plain generation path imports nothing the image lacks (checked on a CPU with
# those packages blocked and the image's transformers 5.17), so no wheel is needed for the
# checks. llguidance (structured outputs, imported only by a constrained request) is carried
# so that the whole engine imports there; bitsandbytes is not (its wheel alone is near the
# 64 MiB limit): the int8/nf4 check then prints "skipped".
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu-carry
WHEELS="llguidance==1.9.1"

if [ "${1:-}" = "run" ]; then
    if compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$CARRY"/wheels/*.whl || echo "gpu_carry: the carried wheels did not install; going on without them" >&2
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    log="${OUT:-/tmp}/gpu_check.log"
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --device cuda --tokenizer "$CARRY/tokenizer" "${@:2}" 2>&1 \
        | tee "$log"
    exit "${PIPESTATUS[0]}"
fi

rm -rf "$CARRY"
mkdir -p "$CARRY/wheels"
python3 - "$CARRY/tokenizer" <<'EOF'
import sys
from pathlib import Path

sys.path[:0] = ["benchmarks", "."]
import gpu_models

gpu_models.copy_tokenizer(gpu_models.find_tokenizer(), Path(sys.argv[1]))
EOF
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$CARRY/wheels" $WHEELS
grep -qx "/$CARRY/" .gitignore 2>/dev/null || echo "gpu_carry: add /$CARRY/ to .gitignore so it stays out of commits" >&2
du -sh "$CARRY"
ls "$CARRY/tokenizer" "$CARRY/wheels"
