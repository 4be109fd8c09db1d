#!/usr/bin/env bash
# Run HERE (network to PyPI), once, before the device call that runs tools/gpu_check.sh.
#   1. .whl/: wheels the GPU machine lacks (gguf, llguidance), the versions this checkout's
#      .venv has, for CPython 3.12 on manylinux x86_64; their Requires-Dist are printed.
#   2. .gpu/: a reduced real model (the default SmolLM2-135M-Instruct Q4_1 GGUF cut to its first
#      N blocks, ~39 MiB for N=4) plus its tokenizer (gzipped fallback), checked with pagellm.
#   3. /.gpu/ in .git/info/exclude (never committed; it travels through `carry`).
# Prints what will travel and its size (the device tool copies at most 64 MiB).
#
#   bash tools/gpu_prepare.sh [--layers N] [--skip-model] [--with-server]
# --with-server also fetches fastapi/uvicorn/pydantic and their deps (not needed by the checks).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV_PY=${VENV_PY:-$ROOT/.venv/bin/python}
PIP_PY=${PIP_PY:-python3}
LAYERS=4
SKIP_MODEL=0
WITH_SERVER=0
while [ $# -gt 0 ]; do
  case "$1" in
    --layers) LAYERS=$2; shift 2 ;;
    --skip-model) SKIP_MODEL=1; shift ;;
    --with-server) WITH_SERVER=1; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

version_of() {  # the version this checkout's venv has
  "$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"
}

PLATFORMS=(--platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
           --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)

fetch() {  # fetch NAME [binary]: NAME==<venv version> into .whl/
  local name=$1 kind=${2:-pure} ver
  ver=$(version_of "$name")
  if ls .whl/ 2>/dev/null | grep -qi "^$(echo "$name" | tr '-' '_')-$ver-"; then
    echo "  have $name==$ver"
    return
  fi
  echo "  fetching $name==$ver ($kind)"
  if [ "$kind" = binary ]; then
    "$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${PLATFORMS[@]}" -d .whl "$name==$ver"
  else
    "$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${PLATFORMS[@]}" --platform any -d .whl "$name==$ver"
  fi
}

echo "== wheels -> .whl/"
mkdir -p .whl
fetch gguf
fetch llguidance binary
if [ "$WITH_SERVER" = 1 ]; then
  for p in fastapi starlette annotated-doc typing-inspection anyio sniffio uvicorn click h11 \
           pydantic annotated-types; do fetch "$p"; done
  fetch pydantic_core binary
fi
echo "-- Requires-Dist of each wheel (GPU side has: numpy pyyaml tqdm torch transformers" \
     "tokenizers safetensors jinja2 httpx psutil prometheus-client matplotlib pytest)"
for w in .whl/*.whl; do
  reqs=$(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
         | sed 's/Requires-Dist: //' | tr '\n' ';' || true)
  printf '  %-62s %s\n' "$(basename "$w")" "${reqs:-(none)}"
done

if [ "$SKIP_MODEL" = 0 ]; then
  echo "== reduced model -> .gpu/"
  "$VENV_PY" tools/gpu_make_model.py --layers "$LAYERS" --out "$ROOT/.gpu"
fi

EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
if ! grep -qxF '/.gpu/' "$EXCLUDE" 2>/dev/null; then
  echo '/.gpu/' >> "$EXCLUDE"
  echo "added /.gpu/ to $EXCLUDE"
fi

echo "== what travels (tracked + untracked-not-ignored + carry [.whl, .gpu])"
ls -la .whl .gpu
tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
others=$(git ls-files -z -o --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
whl=$(du -sb .whl | cut -f1)
gpu=$(du -sb .gpu | cut -f1)
total=$((tracked + others + whl + gpu))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "  tracked files:            $(mib "$tracked")"
echo "  untracked, not ignored:   $(mib "$others")"
echo "  .whl/:                    $(mib "$whl")"
echo "  .gpu/:                    $(mib "$gpu")"
echo "  total:                    $(mib "$total") (device tool limit 64 MiB)"
if [ "$total" -gt $((60 * 1048576)) ]; then
  echo "WARNING: over 60 MiB; use --layers with fewer blocks" >&2
  exit 1
fi
echo "ready: run tools/gpu_check.sh on the device with carry [\".whl\", \".gpu\"]"
