#!/usr/bin/env bash
# GPU figures (bench/bench_gpu.py) on a lent GPU machine, in two steps:
#   bash bench/gpu.sh prepare   # here: the target's config + tokenizer into .gpu/assets, the Python packages
#                               # the GPU image lacks into .whl/ (both git-ignored via .git/info/exclude)
#   bash bench/gpu.sh run       # there (device tool, carry [".gpu", ".whl"]): installs .whl, runs the bench
# Results: $OUT/gpu.json and $OUT/gpu.md ($OUT defaults to bench/out/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS="omegaconf==2.4.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchdata==0.11.0"

case "${1:-}" in
  prepare)
    mkdir -p .git/info .gpu/assets
    for p in /.gpu/ /.whl/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
    src=$(.venv/bin/python -c "from distill.models.resolve import resolve_model; print(resolve_model('smollm2-135m-instruct', key='target.model'))")
    for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
      cp "$src/$f" .gpu/assets/ 2>/dev/null || true
    done
    # The GPU image runs Python 3.12 and has torch, transformers, lightning; these pure-Python packages it lacks.
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d .whl $WHEELS
    du -sh .gpu .whl
    ;;
  run)
    if compgen -G ".whl/*.whl" > /dev/null; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=/tmp/site:$PWD
    fi
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    nvidia-smi -L || true
    shift
    $PY -m bench.bench_gpu --assets .gpu/assets --out-dir "${OUT:-bench/out/gpu}" "$@"
    ;;
  *)
    echo "usage: bash bench/gpu.sh prepare | run [bench_gpu args]" >&2
    exit 2
    ;;
esac
