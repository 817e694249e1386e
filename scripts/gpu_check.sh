#!/usr/bin/env bash
# The GPU conformance run: the conformance suite on CuPy, on torch with CUDA and on JAX's GPU
# platform, the three at once (pytest-xdist workers each), on one NVIDIA machine.
#
# Why a script: the GPU machine is lent for minutes, bare, offline; this installs what it lacks
# from carried wheels (.whl/, ignored by git: array-api-compat), runs the source tree without
# `pip install` (the registry's built-in table stands in for the entry points) and leaves in $OUT
# one log and a JUnit XML per backend. conformance/README.md ("GPU conformance run") records a run.
#
#   OUT=/tmp/gpu scripts/gpu_check.sh                      # all three; exit 1 if any failed
#   GPU_CHECK_RUNS="torch" GPU_CHECK_LIMIT=120 scripts/gpu_check.sh
#   GPU_CHECK_CPU=1 GPU_CHECK_RUNS="torch jax" scripts/gpu_check.sh   # dry run of the script on a CPU box
#
# GPU_CHECK_LIMIT: seconds per suite (then SIGINT: pytest still writes its summary and XML);
# GPU_CHECK_WORKERS: xdist workers per suite (default 4/4/8 on 16 cores: JAX compiles most); GPU_CHECK_ARGS: more pytest args.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
RUNS=${GPU_CHECK_RUNS:-"cupy torch jax"}
LIMIT=${GPU_CHECK_LIMIT:-300}
CPU=${GPU_CHECK_CPU:-0}
LOG=$OUT/log

if ! "$PY" -c "import array_api_compat" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "cannot install the carried wheels (.whl/)" | tee -a "$LOG"; exit 2; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$ROOT/src:$ROOT/backends:$ROOT
export PYTHONUNBUFFERED=1
# one GPU shared by ~16 worker processes: JAX must not take 75% of it in each
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export MESHEMBED_CACHE=${MESHEMBED_CACHE:-/tmp/meshembed-cache}

{
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC')  $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null) (+ working tree)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -3
    "$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version(), platform.machine())
for m in ("numpy", "array_api_compat", "torch", "jax", "jaxlib", "cupy", "pytest", "xdist", "hypothesis", "google.protobuf"):
    try:
        mod = importlib.import_module(m)
        print(f"  {m} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"  {m}: not importable ({exc})")
EOF
} 2>&1 | tee -a "$LOG"

# Each run: name, the MESHEMBED_TEST_BACKENDS list, workers, extra environment.
declare -A NAMES=([cupy]="cupy" [torch]="torch,torch-module,torch-module-compiled" [jax]="jax,jax-functional")
declare -A WORKERS=([cupy]=4 [torch]=4 [jax]=8)
if [ -n "${GPU_CHECK_WORKERS:-}" ]; then for r in cupy torch jax; do WORKERS[$r]=$GPU_CHECK_WORKERS; done; fi
declare -A ENVS=([cupy]="" [torch]="MESHEMBED_TORCH_DEVICE=cuda" [jax]="")
if [ "$CPU" = 1 ]; then ENVS[torch]=""; fi

# Where each backend's arrays live (a suite that silently ran on the CPU would prove nothing).
for run in $RUNS; do
    env ${ENVS[$run]} "$PY" - "$run" "$CPU" <<'EOF' 2>&1 | tee -a "$LOG"
import sys
import meshembed as me
run, cpu = sys.argv[1], sys.argv[2] == "1"
try:
    b = me.get_backend(run)
except me.BackendUnavailableError as exc:
    print(f"[{run}] unavailable: {exc}")
    sys.exit(0)
x = b.asarray([1.0, 2.0], dtype="float32")
where = {"cupy": lambda: f"cuda:{x.device.id}", "torch": lambda: str(x.device),
         "jax": lambda: ",".join(sorted(d.platform for d in x.devices()))}[run]()
print(f"[{run}] arrays on {where}; capabilities {b.capabilities}")
if run == "cupy":  # segment sums in np.add.at's order, bit for bit (meshembed_array_api.native.rows_in_order)
    import numpy as np
    rng = np.random.default_rng(0)
    for dtype in ("float32", "float64", "float16"):
        ids = np.minimum(rng.zipf(1.2, 5000), 300).astype(np.int64)
        vals = rng.standard_normal((5000, 16)).astype(dtype)
        uids = np.unique(ids)
        want = np.zeros((uids.size, 16), dtype)
        np.add.at(want, np.searchsorted(uids, ids), vals)
        got = b.to_numpy(b.segment_sum(b.asarray(ids), b.asarray(vals))[1])
        print(f"[cupy] segment_sum {dtype} vs np.add.at: {int((got != want).sum())} of {want.size} elements differ")
if not cpu and "cuda" not in where and "gpu" not in where:
    sys.exit(f"[{run}] arrays are not on the GPU")
EOF
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "[$run] device check failed: not run" | tee -a "$LOG"; RUNS=${RUNS/$run/}; }
done

pids=()
for run in $RUNS; do
    echo "== [$run] MESHEMBED_TEST_BACKENDS=${NAMES[$run]} ${ENVS[$run]} pytest conformance -n ${WORKERS[$run]}" | tee -a "$LOG"
    env MESHEMBED_TEST_BACKENDS="${NAMES[$run]}" ${ENVS[$run]} \
        timeout -s INT -k 60 "$LIMIT" "$PY" -m pytest conformance -q -p no:cacheprovider -n "${WORKERS[$run]}" \
        -rfE --junitxml "$OUT/junit-$run.xml" -o junit_family=xunit1 ${GPU_CHECK_ARGS:-} >"$OUT/$run.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done

for run in $RUNS; do
    { echo "== [$run] output (passes, skips folded)"; grep -v -E '^([.sxX]+ *(\[ *[0-9]+%\])?|SKIPPED \[.*)$' "$OUT/$run.log"; } >>"$LOG"
done
"$PY" - "$OUT" $RUNS <<'EOF' 2>&1 | tee -a "$LOG"
"""Per backend: passed/failed/skipped from the JUnit XML, then each failure's id and first line."""
import collections, sys, xml.etree.ElementTree as ET
out, runs = sys.argv[1], sys.argv[2:]
for run in runs:
    try:
        cases = ET.parse(f"{out}/junit-{run}.xml").getroot().iter("testcase")
    except (OSError, ET.ParseError) as exc:
        print(f"[{run}] no JUnit XML ({exc})")
        continue
    counts, failed = collections.Counter(), []
    for case in cases:
        kids = {k.tag: k for k in case}
        kind = next((t for t in ("failure", "error", "skipped") if t in kids), "passed")
        if kind == "skipped" and kids["skipped"].get("type") == "pytest.xfail":
            kind = "xfail"
        counts[kind] += 1
        if kind in ("failure", "error"):
            msg = (kids[kind].get("message") or "").splitlines()
            failed.append(f"    {case.get('classname')}::{case.get('name')}: {msg[0][:200] if msg else ''}")
    cut = "KeyboardInterrupt" in open(f"{out}/{run}.log", errors="replace").read()
    print(f"[{run}] " + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failure", "error", "skipped", "xfail"))
          + ("  (INTERRUPTED at GPU_CHECK_LIMIT: the rest did not run)" if cut else ""))
    print("\n".join(failed[:60]))
EOF
echo "== done $(date -u '+%H:%M:%S'), exit $status" | tee -a "$LOG"
exit $status
