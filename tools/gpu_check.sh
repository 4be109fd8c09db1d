#!/usr/bin/env bash
# Run THERE, in the repo root of the copy on the GPU machine (one device call, carry
# [".whl", ".gpu"]; prepare them here first with tools/gpu_prepare.sh):
#     bash tools/gpu_check.sh
# Installs .whl/*.whl into /tmp/site (no network, no deps), prints the machine and versions,
# runs tests/test_triton_attention.py on CUDA, tools/gpu_check.py, then tests/test_engine_parity.py
# (device "auto" = CUDA there; informational), each under its own timeout so that the whole
# run ends within ~7.5 minutes. Logs and JSON go to $OUT (./gpu_out when OUT is unset):
#   env.txt, pytest_triton.log, gpu_check.log, gpu_check.json, gpu_check_summary.txt,
#   pytest_engine_parity.log, all.log (everything, as printed)
# Timeouts (seconds) can be changed: T_TRITON, T_CHECK, T_PARITY; CHECK_ARGS adds arguments
# to gpu_check.py (e.g. CHECK_ARGS="--only kernel,parity").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export OUT
START=$(date +%s)
T_TRITON=${T_TRITON:-100}
T_CHECK=${T_CHECK:-290}
T_PARITY=${T_PARITY:-50}
PY=${PY:-$(command -v python3)}

stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }

main() {
stamp "== install wheels from .whl/ into /tmp/site"
SITE=/tmp/site
mkdir -p "$SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
  for w in .whl/*.whl; do  # one at a time: a wheel this platform refuses never blocks the others
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
         --target "$SITE" "$w" >/tmp/pip.log 2>&1; then
      echo "  installed $(basename "$w")"
    else
      echo "  FAILED $(basename "$w"):"; tail -3 /tmp/pip.log
    fi
  done
else
  echo "  no .whl/ here (carry [\".whl\", \".gpu\"] in the device call)"
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
ls -la .gpu 2>/dev/null || echo "  no .gpu/ here: the reduced real model is missing"

stamp "== machine and versions"
{
  date -u
  uname -a
  (ldd --version 2>&1 | head -1) || true
  nproc
  free -g 2>/dev/null | head -2 || true
  nvidia-smi 2>&1 || echo "nvidia-smi failed"
  command -v cc gcc 2>/dev/null || echo "no C compiler (pagellm's CPU kernels fall back to PyTorch)"
  "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
          round(p.total_memory / 2**30, 1), "GiB")
for m in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "gguf", "llguidance",
          "jinja2", "fastapi", "pydantic"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:14s}", getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as e:
        print(f"{m:14s} MISSING ({type(e).__name__}: {e})")
try:
    import pagellm.engine.llm_engine  # what LLM() imports (llguidance included)
    print("pagellm engine imports: ok")
except Exception as e:
    print(f"pagellm engine imports: FAILED {type(e).__name__}: {e}")
EOF
} 2>&1 | tee "$OUT/env.txt"

stamp "== pytest tests/test_triton_attention.py (CUDA; bf16 included) [timeout ${T_TRITON}s]"
timeout -k 10 "$T_TRITON" "$PY" -m pytest -q -p no:cacheprovider -rfEs \
  tests/test_triton_attention.py 2>&1 | tee "$OUT/pytest_triton.log"
RC_TRITON=${PIPESTATUS[0]}
stamp "pytest triton rc=$RC_TRITON"

stamp "== tools/gpu_check.py [timeout ${T_CHECK}s]"
BUDGET=$(( T_CHECK - 35 ))
# shellcheck disable=SC2086
timeout -k 10 "$T_CHECK" "$PY" tools/gpu_check.py --out "$OUT" --budget-s "$BUDGET" \
  ${CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_check.log"
RC_CHECK=${PIPESTATUS[0]}
stamp "gpu_check rc=$RC_CHECK"

stamp "== pytest tests/test_engine_parity.py (device auto = CUDA here; informational) [timeout ${T_PARITY}s]"
timeout -k 10 "$T_PARITY" "$PY" -m pytest -q -p no:cacheprovider -rfEs --maxfail=20 \
  tests/test_engine_parity.py 2>&1 | tail -60 > "$OUT/pytest_engine_parity.log"
RC_PARITY=${PIPESTATUS[0]}
cat "$OUT/pytest_engine_parity.log"
stamp "pytest engine parity rc=$RC_PARITY"

stamp "== done: triton tests rc=$RC_TRITON, gpu_check rc=$RC_CHECK, engine parity tests rc=$RC_PARITY (124 = timeout)"
[ -f "$OUT/gpu_check_summary.txt" ] && cat "$OUT/gpu_check_summary.txt"
ls -la "$OUT"
[ "$RC_TRITON" = 0 ] && [ "$RC_CHECK" = 0 ]
}

main "$@" 2>&1 | tee -a "$OUT/all.log"
exit "${PIPESTATUS[0]}"
