#!/usr/bin/env bash
# Builds jax_ls2 on a GPU machine, runs the GPU tests and the benchmarks, writes
# logs and CSVs to $OUT (default a fresh bench/results/runs/<date>_<commit>, which git ignores),
# prints a short table last. Its CSVs join the long history with
#   python -m bench.report append $OUT --run <gpu>-<date>
#   bash bench/gpu_check.sh [quick|tests|bench|sweep|sanitize|models|scaling|ncu]...   (default: tests bench)
# quick: every GPU test and the standard benchmarks (bench/quick.py), the table last.
# Env: PACK_TO, TEST_FILES, TEST_K (pytest -k), TEST_WORKERS, QUICK_JOBS (compiles at once), SWEEPS (cross_entropy dropout optim softmax layer_norm_bwd; DROPOUT_ONLY, DROPOUT_VARIANTS, SOFTMAX_VARIANTS), BENCHES (e.g. "bench_layer_norm bench_optim"), BENCH_DTYPES, OPTIM_PARTS,
# MODELS_ARGS (e.g. "--models llama-small llama-1b"), SCALING_ARGS (bench_scaling, e.g. "--models gpt2-small"), DECODE_ARGS (bench_decode, e.g. "--models llama-1b"), NCU_KERNELS / NCU_ARGS (bench/profile_kernels.py) / NCU_EXTRA (more ncu flags), SANITIZE_TOOLS / SANITIZE_FILES / SANITIZE_KERNELS, and *_TIMEOUT
# limits (OPTIM_TIMEOUT for bench_optim, DECODE_TIMEOUT for bench_decode, SCALING_TIMEOUT for bench_scaling) in seconds. JAX_LS2_COMMIT labels the rows (default the tree's git HEAD; give it when the files are newer than that HEAD).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/results/runs/$(date -u +%Y%m%dT%H%MZ)_$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
STEPS=${*:-tests bench}
# The kernels are built explicitly (JAX_LS2_BUILD_CUDA=1): a build that skipped them would
# leave every op on its reference and every GPU test skipped.
export PYTHONUNBUFFERED=1 JAX_LS2_BUILD_CUDA=1 JAX_LS2_CUDA_ARCHS=${JAX_LS2_CUDA_ARCHS:-90} JAX_LS2_COMMIT=${JAX_LS2_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}
summary=()
# PACK_TO=file.tgz: after every step, the logs and CSVs so far are packed into that one
# file (for machines that return few files, or stop a run at a time limit).
pack() { [ -n "${PACK_TO:-}" ] && tar -czf "$PACK_TO" -C "$OUT" . 2>/dev/null; true; }

t0=$(date +%s)
if ! $PY -m pip install -v --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
summary+=("build: ok in $(( $(date +%s) - t0 )) s; slowest sources: $(grep -oE '\[[0-9]+/[0-9]+\] [^ ]+ \([0-9]+ s\)' "$OUT/build.log" | sed -E 's/^\[[0-9/]+\] //' | sort -t'(' -k2 -n | tail -3 | tr '\n' ' ')")
$PY -c "import jax, jax_ls2; print(jax.devices(), 'kernels:', jax_ls2.cuda_available(), sorted(jax_ls2.registered_targets()))" 2>&1 | tail -2

for step in $STEPS; do
  case $step in
    tests)
      # Every GPU test in one pytest session over TEST_WORKERS processes (bench/gpu_tests.py).
      $PY -m bench.gpu_tests --out "$OUT" --timeout ${TEST_TIMEOUT:-300} ${TEST_WORKERS:+--workers $TEST_WORKERS} \
        ${TEST_K:+-k "$TEST_K"} ${TEST_FILES:-tests} >"$OUT/gpu_tests_summary.log" 2>&1
      summary+=("$(cat "$OUT/gpu_tests_summary.log")")
      pack
      ;;
    quick)
      # The GPU tests and the standard benchmarks' compiles side by side; the timings
      # (one process at a time, bench/quick.py) start once both have ended.
      t0=$(date +%s)
      done_flag=$(mktemp -u /tmp/jax_ls2_tests_done.XXXXXX)
      JAX_LS2_IMPL=${JAX_LS2_IMPL:-cuda} $PY -m bench.quick --out "$OUT" --after "$done_flag" --timeout ${QUICK_TIMEOUT:-460} \
        ${QUICK_JOBS:+--jobs $QUICK_JOBS} >"$OUT/quick.log" 2>&1 &
      quick_pid=$!
      $PY -m bench.gpu_tests --out "$OUT" --timeout ${TEST_TIMEOUT:-300} ${TEST_WORKERS:+--workers $TEST_WORKERS} \
        ${TEST_K:+-k "$TEST_K"} ${TEST_FILES:-tests} >"$OUT/gpu_tests_summary.log" 2>&1
      touch "$done_flag"
      cat "$OUT/gpu_tests_summary.log"
      pack
      wait $quick_pid
      quick_rc=$?
      rm -f "$done_flag"
      summary+=("$(cat "$OUT/gpu_tests_summary.log")")
      summary+=("standard benchmarks: exit $quick_rc, $(( $(date +%s) - t0 )) s with the tests; table below")
      pack
      ;;
    sanitize)
      t0=$(date +%s)
      # XLA_PYTHON_CLIENT_ALLOCATOR=platform: every buffer its own cudaMalloc, so memcheck
      # sees each buffer's bounds (inside XLA's pooled allocator an overrun lands in
      # another buffer of the pool, which memcheck cannot tell from a valid access).
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        # Only jax_ls2's kernels are checked (SANITIZE_KERNELS): racecheck reports the
        # mbarrier-synchronised shared-memory pipelines of cuBLAS's sm90 GEMMs as races by
        # the thousand, and checking them took the whole time limit (592edfd + 1 run).
        # Autotuning off: racecheck stopped at an internal error ("failed to handle a
        # hardware exception") while XLA profiled GEMM candidates (d26e552 run).
        XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
        XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${SANITIZE_TIMEOUT:-600} compute-sanitizer --tool $tool \
          --kernel-name ${SANITIZE_KERNELS:-kns=jax_ls2} \
          --error-exitcode 9 $PY -m pytest ${SANITIZE_FILES:-tests} -m "gpu and sanitize" -q \
          -p no:cacheprovider >"$OUT/sanitizer_$tool.log" 2>&1
        summary+=("compute-sanitizer $tool: exit $? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1) $(tail -1 "$OUT/sanitizer_$tool.log")")
        pack
      done
      pack
      ;;
    ncu)
      # Hardware counters of the kernels short of the bar (bench/profile_kernels.py).
      t0=$(date +%s)
      # No preallocation: kernel replay saves and restores the device memory in use, and
      # with XLA's default pool (85% of the GPU) that stalls at the first kernel.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${NCU_TIMEOUT:-300} ncu --clock-control none --kernel-name-base demangled \
        --kernel-name "${NCU_KERNELS:-regex:jax_ls2}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
        --section InstructionStats --section SchedulerStats ${NCU_EXTRA:-} \
        $PY -m bench.profile_kernels ${NCU_ARGS:-} >"$OUT/ncu.txt" 2>&1
      summary+=("ncu: exit $? ($(( $(date +%s) - t0 )) s), see ncu.txt")
      pack
      ;;
    bench)
      for name in ${BENCHES:-$(cd bench && ls bench_*.py | sed 's/\.py$//')}; do
        [ "$name" = bench_models ] || [ "$name" = bench_scaling ] && continue
        case $name in
          bench_layer_norm|bench_dropout|bench_softmax|bench_cross_entropy|bench_llama_ops) args="--dtypes ${BENCH_DTYPES:-bfloat16}" ;;
          bench_optim) args="--parts ${OPTIM_PARTS:-update}" ;;
          bench_decode) args="${DECODE_ARGS:-}" ;;
          *) args="" ;;
        esac
        t0=$(date +%s)
        limit=${BENCH_TIMEOUT:-300}
        [ "$name" = bench_optim ] && limit=${OPTIM_TIMEOUT:-$limit}
        # 8 fresh processes (2 models x batches 1 and 32 x 2 impls), each compiling its generation
        [ "$name" = bench_decode ] && limit=${DECODE_TIMEOUT:-540}
        if timeout $limit $PY -m bench.$name --out "$OUT" $args >"$OUT/$name.log" 2>&1; then
          summary+=("$name: ok ($(( $(date +%s) - t0 )) s)")
        else
          summary+=("$name: FAILED ($(( $(date +%s) - t0 )) s), see $name.log"); tail -5 "$OUT/$name.log"
        fi
        pack
      done
      ;;
    sweep)
      # Launch-option variants beside the defaults (bench/PERF_NOTES.md, "Launch options").
      t0=$(date +%s)
      run_sweep() {  # name, module, args...
        local name=$1 mod=$2; shift 2
        mkdir -p "$OUT/sweep_$name"
        timeout ${SWEEP_TIMEOUT:-200} $PY -m bench.$mod --out "$OUT/sweep_$name" "$@" \
          >"$OUT/sweep_$name.log" 2>&1
        summary+=("sweep $name: exit $?")
        pack
      }
      for name in ${SWEEPS:-cross_entropy dropout optim}; do
        case $name in
          cross_entropy) run_sweep cross_entropy bench_cross_entropy --dtypes bfloat16 --reps 30 \
                           --variants cross_entropy_pipeline=1 ;;
          dropout) run_sweep dropout bench_dropout --dtypes bfloat16 --reps 30 \
                     --only ${DROPOUT_ONLY:-bias_dropout_residual:bwd,bias_act_dropout_gelu:bwd} \
                     --variants ${DROPOUT_VARIANTS:-dropout_rows_in_flight=4} ;;
          optim) run_sweep optim bench_optim --parts ${OPTIM_PARTS:-update} ;;
          softmax) run_sweep softmax bench_softmax --dtypes bfloat16 --reps 30 \
                     --variants ${SOFTMAX_VARIANTS:-softmax_elems=16} ;;
          layer_norm_bwd) run_sweep layer_norm_bwd bench_layer_norm --dtypes bfloat16 --reps 30 \
                            --only layer_norm:bwd,layer_norm_return_input:bwd \
                            --variants ${LN_VARIANTS:-layer_norm_bwd_stages=1,layer_norm_bwd_elems=8,layer_norm_bwd_elems=16} ;;
        esac
      done
      summary+=("sweeps: $(( $(date +%s) - t0 )) s")
      pack
      ;;
    models)
      t0=$(date +%s)
      timeout ${MODELS_TIMEOUT:-540} $PY -m bench.bench_models --out "$OUT" ${MODELS_ARGS:-} >"$OUT/bench_models.log" 2>&1
      summary+=("bench_models: exit $? ($(( $(date +%s) - t0 )) s)")
      pack
      ;;
    scaling)
      t0=$(date +%s)
      timeout ${SCALING_TIMEOUT:-540} $PY -m bench.bench_scaling --out "$OUT" ${SCALING_ARGS:-} >"$OUT/bench_scaling.log" 2>&1
      summary+=("bench_scaling: exit $? ($(( $(date +%s) - t0 )) s)")
      pack
      ;;
  esac
done

echo "================ summary"
printf '%s\n' "${summary[@]}"
$PY - "$OUT" <<'PYEOF'
import csv, glob, sys
for path in sorted(glob.glob(sys.argv[1] + "/*.csv") + glob.glob(sys.argv[1] + "/sweep_*/*.csv")):
    rows = list(csv.DictReader(open(path)))
    ours = [r for r in rows if r.get("impl", "").startswith("jax_ls2")]
    for r in ours:
        variant = r["impl"][len("jax_ls2"):]  # "[option=value]" for sweep rows
        print(f"{r.get('op','')[:22]:<22}{r.get('shape','')[:18]:<18}{r.get('dtype','')[:8]:<9}{r.get('pass','')[:7]:<8}"
              f"{variant[:36]:<37}"
              f"{r.get('ms_median',''):>8}ms {r.get('pct_copy_bw',''):>5}% x{r.get('speedup_vs_xla', ''):<6}"
              f" dev {r.get('device_ms',''):>8}ms {r.get('device_pct_copy_bw',''):>5}% x{r.get('device_speedup_vs_xla','')}")
PYEOF
[ -f "$OUT/quick.log" ] && sed -n '/^==== standard benchmarks/,$p' "$OUT/quick.log"
echo "append these results to bench/results/results.csv with: python -m bench.report append $OUT --run <gpu>-<date>"
