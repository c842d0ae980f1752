#!/usr/bin/env bash
# GPU proof for scaler-core, in one go, without network.
#
# Usage (on a machine with an NVIDIA GPU, CuPy, JAX with CUDA and PyTorch installed):
#     bash benchmarks/gpu_check.sh OUTDIR
# It (1) installs scaler-core from this working tree into $PYTHON (default python3) with pip
# --no-index --no-deps --no-build-isolation (falling back to a copied package on PYTHONPATH if
# pip cannot), (2) runs the CuPy tests (+ the docs pages' CuPy examples) on the GPU, (3) runs
# benchmarks/bench_gpu.py on both sets, (4) runs the JAX tests on the GPU, (5) optionally reruns
# the 2000-array set with the JAX contenders, and (6) prints a summary. Each stage runs even if
# an earlier one failed; a global deadline (GPU_CHECK_BUDGET_S, default 450 s) keeps the whole
# run under 8 minutes. Written under OUTDIR:
#     gpu_check.log            everything printed
#     env.txt                  GPU, driver and library versions
#     pytest-cupy.{log,xml}    CuPy backend tests, the docs pages' CuPy examples and the torch
#                              drop-in's CUDA tests, on the GPU
#     pytest-jax.{log,xml}     JAX backend tests on the GPU
#     bench_gpu-SET.json       benchmark results per set
#     bench_step-cuda.json     the whole step: PyTorch's recipe against the folded clip_and_step
#     summary.json             stage results, test counts, benchmark goals
#   and at the end everything but these two is packed into details.tar.gz (so a device
#   run brings back three files).
# Exit status: 0 when every test passed and the benchmarks ran, 1 otherwise.
set -u -o pipefail

OUT=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
START=$(date +%s)
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false # JAX must not take the GPU from CuPy and PyTorch
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/scaler-core-cupy-cache}
export HYPOTHESIS_PROFILE=ci
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!

export PY OUT ROOT
STAGES=()
note() { STAGES+=("$1|$2|$3"); echo "== $1: $2 (${3}s)"; }

# stage NAME LIMIT_S LOG CMD...: run CMD (a program or a function of this script) with a time
# limit capped by the global deadline; its output goes to LOG, or to the console if LOG is "-".
stage() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((BUDGET_S - ($(date +%s) - START)))
    if ((left < 20)); then
        note "$name" "not run: the ${BUDGET_S}s budget is spent" 0
        return 1
    fi
    ((limit > left)) && limit=$left
    echo
    echo "== $name (limit ${limit}s): $*"
    local t0 rc cmd=("$@")
    if declare -F "$1" >/dev/null; then
        cmd=(bash -c "$(declare -f "$1"); $*")
    fi
    t0=$(date +%s)
    if [[ $log == - ]]; then
        timeout -k 10 "$limit" "${cmd[@]}"
    else
        timeout -k 10 "$limit" "${cmd[@]}" >"$log" 2>&1
    fi
    rc=$?
    if ((rc == 124 || rc == 137)); then
        note "$name" "TIMED OUT after ${limit}s" $(($(date +%s) - t0))
    elif ((rc == 0)); then
        note "$name" "ok" $(($(date +%s) - t0))
    else
        note "$name" "FAILED rc=$rc" $(($(date +%s) - t0))
    fi
    return $rc
}

# ---------------------------------------------------------------- environment
env_report() {
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$PY" -P - <<'PY'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("numpy", "ml_dtypes", "cupy", "jax", "jaxlib", "torch", "hypothesis", "pytest", "setuptools"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "MISSING", type(exc).__name__, exc)
try:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    p = cupy.cuda.runtime.getDeviceProperties(0)
    print("cupy devices", n, p["name"], "cc", p["major"], p["minor"], "SMs", p["multiProcessorCount"])
    print("cuda runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
except Exception as exc:
    print("cupy GPU", "UNAVAILABLE", type(exc).__name__, exc)
try:
    import jax
    print("jax devices", jax.devices())
except Exception as exc:
    print("jax devices", "UNAVAILABLE", type(exc).__name__, exc)
try:
    import torch
    print("torch cuda", torch.cuda.is_available(), torch.version.cuda)
except Exception as exc:
    print("torch", "UNAVAILABLE", type(exc).__name__, exc)
PY
}
stage env 60 "$OUT/env.txt" env_report
cat "$OUT/env.txt"

# -------------------------------------------------------------------- install
install_pip() {
    "$PY" -m pip install --no-index --no-deps --no-build-isolation --force-reinstall -q . &&
        (cd /tmp && "$PY" -P -c "import scaler_core.backends._numpy as m, scaler_core; print('installed:', m.__file__)")
}
install_copy() {
    # No pip: lay the package out as the wheel does (backends/ inside scaler_core/).
    local pkg
    pkg=$(mktemp -d)/site
    mkdir -p "$pkg" && cp -r scaler_core "$pkg/" && rm -rf "$pkg/scaler_core/backends" &&
        cp -r backends "$pkg/scaler_core/backends" && echo "$pkg" >"$OUT/.pythonpath" &&
        (cd /tmp && PYTHONPATH="$pkg" "$PY" -P -c "import scaler_core.backends._numpy as m; print('on PYTHONPATH:', m.__file__)")
}
INSTALLED=0
if stage install 120 - install_pip; then
    INSTALLED=1
elif stage install-fallback 60 - install_copy; then
    INSTALLED=1
    export PYTHONPATH
    PYTHONPATH=$(cat "$OUT/.pythonpath")
fi
OK=$INSTALLED

# ---------------------------------------------------------------------- tests
# -P: the source tree's scaler_core/ must not shadow the installed package. Warnings are shown
# rather than turned into errors (CI on the CPU keeps them errors): a third-party deprecation
# must not void this one-shot run.
PYTEST=("$PY" -P -m pytest -p no:cacheprovider -rs -v -W default)
# The GPU tests, the CuPy rows of the backend contract suite (every check on the GPU), the
# docs pages' CuPy examples, and the PyTorch drop-in's CUDA tests (in the same log, to keep
# the files that come back few).
cupy_tests=(tests/backends/test_cupy_gpu.py tests/backends/test_cupy_cpu.py
    tests/backends/test_contract.py)
[[ -f tests/docs/test_pages.py ]] && cupy_tests+=(tests/docs/test_pages.py)
[[ -f tests/integrations/test_torch_cuda.py ]] && cupy_tests+=(tests/integrations/test_torch_cuda.py)
stage pytest-cupy 260 "$OUT/pytest-cupy.log" "${PYTEST[@]}" --junitxml="$OUT/pytest-cupy.xml" \
    "${cupy_tests[@]}" || OK=0
tail -n 40 "$OUT/pytest-cupy.log"

# ------------------------------------------------------------------ benchmark
# Order: what matters most first. The JAX contenders of the 2000-array set come last, as an
# optional extra: XLA compiles one program over 2000 leaves, which can take long.
stage bench-gpt2-small 120 - "$PY" -P benchmarks/bench_gpu.py --sets gpt2-small \
    --json "$OUT/bench_gpu-gpt2-small.json" || OK=0
stage bench-2000x1024 60 - "$PY" -P benchmarks/bench_gpu.py --sets 2000x1024 --no-jax \
    --json "$OUT/bench_gpu-2000x1024.json" || OK=0

# The PyTorch drop-in against PyTorch's class, and the torch backend's route (PyTorch's kernel
# against CuPy's through DLPack); printed into gpu_check.log only.
stage bench-torch-cuda 90 - "$PY" -P benchmarks/bench_torch.py --device cuda --reps 15 \
    --cycle-reps 101 || OK=0
# Unscale + detect + clip: PyTorch's unscale_ + clip_grad_norm_(foreach=True) against
# scaler-core's unscale_and_clip on CuPy views of the same memory; gpu_check.log only.
stage bench-clip-cuda 60 - "$PY" -P benchmarks/bench_clip.py --device cuda --reps 15 || OK=0
# The whole LLM step (GPT-2 small, fused AdamW, clip 1.0): PyTorch's recipe, unscale_and_clip_
# + step, the folded clip_and_step and the one-read bound; its JSON goes into details.tar.gz.
stage bench-step-cuda 90 - "$PY" -P benchmarks/bench_step.py --device cuda --reps 15 \
    --json "$OUT/bench_step-cuda.json" || OK=0

# ------------------------------------------------------------------ JAX tests
mapfile -t jax_tests < <(ls tests/*/test_jax*.py tests/integrations/test_optax.py 2>/dev/null)
if ((${#jax_tests[@]})); then
    stage pytest-jax 200 "$OUT/pytest-jax.log" "${PYTEST[@]}" --junitxml="$OUT/pytest-jax.xml" \
        "${jax_tests[@]}" || OK=0
    tail -n 40 "$OUT/pytest-jax.log"
else
    note pytest-jax "not run: no tests/*/test_jax*.py in this tree" 0
fi

# Optional: the 2000-array set again with the JAX contenders (replaces the numbers above if it
# finishes in the time left; not finishing does not fail the check).
stage bench-2000x1024-jax-optional 120 - "$PY" -P benchmarks/bench_gpu.py --sets 2000x1024 \
    --json "$OUT/bench_gpu-2000x1024-jax.json" || true

# -------------------------------------------------------------------- summary
printf '%s\n' "${STAGES[@]}" >"$OUT/.stages"
"$PY" -P - "$OUT" "$(($(date +%s) - START))" "$OK" <<'PY'
import glob, json, os, sys
import xml.etree.ElementTree as ET

out, total, ok = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
stages = []
for line in open(os.path.join(out, ".stages")):
    name, status, secs = line.rstrip("\n").split("|")
    stages.append({"stage": name, "status": status, "seconds": int(secs)})
tests = {}
for suite in ("cupy", "jax"):
    path = os.path.join(out, f"pytest-{suite}.xml")
    if not os.path.exists(path):
        continue
    root = ET.parse(path).getroot()
    node = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(node.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in node.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    log = os.path.join(out, f"pytest-{suite}.log")
    lines = open(log, errors="replace").read().splitlines() if os.path.exists(log) else []
    skipped = sorted({line[:200] for line in lines if line.startswith("SKIPPED [")})
    tests[suite] = {**counts, "failed": failed, "skip_reasons": skipped}
bench = {}
paths = sorted(glob.glob(os.path.join(out, "bench_gpu-*.json")), key=lambda p: p.endswith("-jax.json"))
for path in paths:  # a finished run with the JAX contenders replaces the one without
    data = json.load(open(path))
    for name, result in data.get("sets", {}).items():
        if path.endswith("-jax.json") and "error" in result:
            continue
        bench[name] = result
    bench.setdefault("_meta", {}).update(
        {k: data.get(k) for k in ("gpu", "date", "cupy", "cuda_runtime", "cuda_driver", "status", "reason")}
    )
    for goal, value in data.get("goals", {}).items():
        bench.setdefault("_goals", {})[goal] = value
ok = ok and all(not t["failed"] and t["failures"] == 0 and t["errors"] == 0 for t in tests.values())
no_gpu = bench.get("_meta", {}).get("status") == "skipped"
ok = ok and not no_gpu and all("error" not in r for k, r in bench.items() if not k.startswith("_"))
summary = {"ok": ok, "gpu": not no_gpu, "seconds": total, "stages": stages, "tests": tests, "benchmark": bench}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)

print("\n================ scaler-core GPU check: summary ================")
meta = bench.get("_meta", {})
print(f"GPU: {meta.get('gpu')}  CuPy {meta.get('cupy')}  CUDA runtime {meta.get('cuda_runtime')} "
      f"driver {meta.get('cuda_driver')}  date {meta.get('date')}  total {total}s")
for s in stages:
    print(f"  stage {s['stage']:<24} {s['status']:<40} {s['seconds']:>4}s")
for suite, t in tests.items():
    print(f"  tests {suite:<6} passed {t['passed']}, failed {t['failures']}, errors {t['errors']}, "
          f"skipped {t['skipped']} of {t['tests']}")
    for f in t["failed"]:
        print(f"      FAILED {f}")
    for r in t["skip_reasons"]:
        print(f"      skip: {r}")
for name, result in bench.items():
    if name.startswith("_"):
        continue
    if "error" in result:
        print(f"  bench {name}: ERROR {result['error']}")
        continue
    for k, r in result.get("results", {}).items():
        vs = "" if r["speedup_vs_torch"] is None else f"  {r['speedup_vs_torch']:.2f}x torch"
        print(f"  bench {name:<11} {k:<18} {r['median_ms']:9.4f} ms {r['gb_per_s']:7.0f} GB/s "
              f"{r['fraction_of_copy_bandwidth']:5.2f} of copy{vs}")
for goal, v in bench.get("_goals", {}).items():
    print(f"  goal  {goal}: {v['value']:.3f} -> {'MET' if v['ok'] else 'NOT MET'}")
if meta.get("status") == "skipped":
    print(f"  bench skipped: {meta.get('reason')}")
if no_gpu:
    print("RESULT: NOT OK: no usable GPU here, so this was a dry run of the script")
else:
    print("RESULT:", "OK" if ok else "NOT OK", f"(see {out}/gpu_check.log)")
sys.exit(0 if ok else 1)
PY
RC=$?
# At most three files come back from a device run: pack the details into one archive.
(cd "$OUT" && find . -maxdepth 1 -type f ! -name gpu_check.log ! -name summary.json \
    ! -name details.tar.gz -printf '%P\n' | tar -czf details.tar.gz -T - &&
    find . -maxdepth 1 -type f ! -name gpu_check.log ! -name summary.json \
        ! -name details.tar.gz -delete)
# Let tee write the last lines to the log before the caller collects OUTDIR.
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null || sleep 1
exit $RC
