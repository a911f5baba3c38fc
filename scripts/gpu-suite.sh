#!/usr/bin/env bash
# The one command for the GPU test machine (docs/gpu.md): from the project's root, after
# `GPU_EXTRA_DEBS="dataset-fashion-mnist libelf-dev libelf1" bash ../shared/gpu/stage-deps.sh` filled .gpu/ here and .gpu/ travelled with the tree,
#
#   bash scripts/gpu-suite.sh --budget 540
#
# unpacks the staged packages, configures and builds Loom against the machine's own torch with
# every core, runs `ctest -L gpu`, then every GPU benchmark, then the rest of the suite, and
# writes logs, JUnit XML and summary.md (card, driver, torch, every figure) under $OUT (or
# --out). It stops at the budget (seconds, counted from its start) and always leaves a summary
# of what ran, what failed and what the budget cut.
#
#   --dry-run        the same steps on this (CPU) machine against the pinned wheel and the
#                    existing build tree: the CUDA tests skip, the benchmarks run short on CPU.
#                    CI runs it so that the script cannot rot.
#   --budget S       seconds for everything (default 540: the device tool's 600 s per command,
#                    less room to copy $OUT back)
#   --out DIR        where logs, JUnit XML and summary.md go (default $OUT, else ./gpu-suite-out)
#   --build-dir DIR  the build tree (default build-gpu; with --dry-run, $LOOM_BUILD_DIR or build)
#   --jobs N         build and test parallelism (default: every core)
#   --skip STEPS     comma-separated steps not to run this time (bench-precision,test-rest: a
#                    second call on a lent machine that already has the earlier figures)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

dry_run=0
budget=540
out="${OUT:-$root/gpu-suite-out}"
build_dir=""
jobs="$(nproc)"
skip=","
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --budget) budget="$2"; shift ;;
    --out) out="$2"; shift ;;
    --build-dir) build_dir="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --skip) skip=",$2,"; shift ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-suite: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$budget" in ''|*[!0-9]*) echo "gpu-suite: --budget '$budget' is not a number of seconds" >&2; exit 2 ;; esac

start=$(date +%s)
deadline=$((start + budget))
mkdir -p "$out/logs" "$out/junit"
out="$(cd "$out" && pwd)"
summary="$out/summary.md"
step_rows=()   # "| step | status | seconds | log |" rows, in order
planned=(unpack setup configure build test-gpu bench-gpt2-large bench-gpt2 bench-profile bench-precision bench-variants bench-parallel bench-memory test-rest)
failures=0

remaining() { echo $((deadline - $(date +%s))); }

# run_step NAME MIN_SECONDS COMMAND...: runs COMMAND with its output in logs/NAME.log, cut at the
# budget; not started when less than MIN_SECONDS remain. A step cut or not run counts as failed:
# the suite did not complete.
run_step() {
  local name="$1" need="$2"
  shift 2
  local log="$out/logs/$name.log" left t0 rc status
  if [[ "$skip" == *",$name,"* ]]; then
    step_rows+=("| $name | skipped (--skip) | 0 | |")
    echo "[gpu-suite] $name: skipped (--skip)" >&2
    return 0
  fi
  left=$(remaining)
  if [ "$left" -lt "$need" ]; then
    step_rows+=("| $name | **not run**: ${left} s of the budget left, at least ${need} s needed | 0 | |")
    echo "[gpu-suite] $name: not run (budget)" >&2
    failures=$((failures + 1))
    return 124
  fi
  echo "[gpu-suite] $name (${left} s of the budget left)" >&2
  t0=$(date +%s)
  timeout --kill-after=15 "$left" "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status="ok" ;;
    124|137) status="**cut by the budget** after $(( $(date +%s) - t0 )) s"; failures=$((failures + 1)) ;;
    *) status="**failed** (exit $rc)"; failures=$((failures + 1)) ;;
  esac
  step_rows+=("| $name | $status | $(( $(date +%s) - t0 )) | logs/$name.log |")
  echo "[gpu-suite] $name: $status" >&2
  if [ $rc -ne 0 ]; then
    tail -n 40 "$log" | sed "s/^/[gpu-suite]   /" >&2
  fi
  return $rc
}

# ---- the summary, written whatever happens ----------------------------------------------------
ctest_result() {  # the closing lines of a ctest log: totals, then what failed or was skipped
  local log="$1"
  [ -f "$log" ] || { echo "(not run)"; return; }
  grep -E "tests passed|tests failed out of" "$log" | tail -n 1
  grep -E "^Total Test time" "$log" | tail -n 1
  sed -n '/The following tests FAILED:/,/^$/p;/The following tests did not run:/,/^$/p' "$log"
}

write_summary() {
  {
    echo "# Loom GPU suite$([ $dry_run = 1 ] && echo ' (dry run on CPU)')"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); budget ${budget} s, used $(( $(date +%s) - start )) s"
    echo "- commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo 'unknown (no .git)')$(git -C "$root" status --porcelain 2>/dev/null | grep -q . && echo ' + uncommitted changes')"
    if command -v nvidia-smi >/dev/null 2>&1; then
      nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null |
        sed 's/^/- GPU (name, driver, memory, capability): /'
    else
      echo "- GPU: none (no nvidia-smi)"
    fi
    echo "- torch: $("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())' 2>/dev/null || echo 'not importable')"
    echo "- nvcc: $( (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | sed -n 's/.*release \([0-9.]*\).*/\1/p' | head -n 1)"
    echo "- CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
    echo "- build: $build_dir"
    local sdk
    sdk="$(ls "$build_dir"/lib/libloom_sdk.so.* 2>/dev/null | head -n 1)"
    if [ -n "$sdk" ]; then
      echo "- compiler: $(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build_dir/CMakeCache.txt" 2>/dev/null);" \
        "libloom_sdk needs libstdc++.so: $(readelf -d "$sdk" 2>/dev/null | grep -q 'libstdc++' && echo yes || echo '**no** (a copy of its own)')"
    fi
    echo
    echo "| step | status | seconds | log |"
    echo "| --- | --- | --- | --- |"
    printf '%s\n' "${step_rows[@]}"
    local step
    for step in "${planned[@]}"; do
      printf '%s\n' "${step_rows[@]}" | grep -q "^| $step |" ||
        echo "| $step | **not reached**: an earlier step failed or the budget ran out | 0 | |"
    done
    echo
    echo "## ctest -L gpu"
    echo '```'
    ctest_result "$out/logs/test-gpu.log"
    grep -E "^ *[0-9]+/[0-9]+ Test +#[0-9]+: " "$out/logs/test-gpu.log" 2>/dev/null | sed 's/^ *//'
    echo '```'
    echo
    echo "## The rest of the suite (ctest -LE gpu)"
    echo '```'
    ctest_result "$out/logs/test-rest.log"
    echo '```'
    local crashed
    for crashed in $(grep -l "crashed with" "$out"/logs/*.log 2>/dev/null); do
      echo
      echo "## A crash in $(basename "$crashed") (scripts/symbolize-crash.sh)"
      echo '```'
      grep -m 3 -A 3 "crashed with" "$crashed"
      bash "$root/scripts/symbolize-crash.sh" "$crashed" | head -n 60
      echo '```'
    done
    for bench in "$out"/logs/bench-*.log; do
      [ -f "$bench" ] || continue
      echo
      echo "## $(basename "$bench" .log)"
      echo '```'
      tail -n 60 "$bench"
      echo '```'
    done
  } >"$summary"
  echo "[gpu-suite] summary: $summary" >&2
}
trap write_summary EXIT

# ---- set-up -------------------------------------------------------------------------------------
if [ $dry_run = 1 ]; then
  # shellcheck source=scripts/env.sh
  source "$root/scripts/env.sh"
  py="$LOOM_VENV/bin/python"
  build_dir="${build_dir:-$LOOM_BUILD_DIR}"
  step_rows+=("| unpack | not needed (dry run: this machine's packages and the pinned wheel) | 0 | |")
  run_step setup 5 bash "$root/scripts/setup.sh" || exit 1
  device=cpu
else
  py="$(command -v python3)"
  build_dir="${build_dir:-$root/build-gpu}"
  if [ -f "$root/.gpu/unpack.sh" ]; then
    run_step unpack 10 bash "$root/.gpu/unpack.sh" || exit 1
    # shellcheck disable=SC1091
    source "$root/.gpu/env.sh"
  else
    step_rows+=("| unpack | no .gpu/ here: using the packages this machine has (see docs/gpu.md) | 0 | |")
  fi
  step_rows+=("| setup | not needed (the machine's own torch) | 0 | |")
  device=cuda
fi
export LOOM_PYTHON="$py"

if [ $dry_run = 1 ]; then  # the settings scripts/build.sh uses, so that both share the tree
  run_step configure 10 cmake --preset dev -B "$build_dir" -DLOOM_PYTHON="$py" || exit 1
else
  # The machine has a partial Boost (CMake files of 1.83 without program_options): the staged
  # Boost under /opt/gpu-deps is the one to use.
  boost=()
  for d in /opt/gpu-deps/usr/lib/x86_64-linux-gnu/cmake/Boost-*; do [ -d "$d" ] && boost=(-DBoost_DIR="$d"); done
  # Its CMake sets no CMAKE_LIBRARY_ARCHITECTURE, so find_library does not look in the staged
  # lib/x86_64-linux-gnu: name the staged libelf (seen on the H200: "libelf not found").
  for f in /opt/gpu-deps/usr/lib/x86_64-linux-gnu/libelf.so; do
    [ -e "$f" ] && boost+=(-DLOOM_LIBELF_LIBRARY="$f" -DLOOM_LIBELF_INCLUDE_DIR=/opt/gpu-deps/usr/include)
  done
  for f in /opt/gpu-deps/usr/lib/x86_64-linux-gnu/libpcre2-8.so; do  # the same for PCRE2
    [ -e "$f" ] && boost+=(-DLOOM_PCRE2_LIBRARY="$f" -DLOOM_PCRE2_INCLUDE_DIR=/opt/gpu-deps/usr/include)
  done
  # and for Gloo's headers (libgloo-dev, staged), which the ddp plugin compiles with
  [ -f /opt/gpu-deps/usr/include/gloo/algorithm.h ] && boost+=(-DLOOM_GLOO_INCLUDE_DIR=/opt/gpu-deps/usr/include)
  # The H200 of 2026-11-27 configured with /opt/gcc/bin/g++ (from its environment), whose link
  # finds no shared libstdc++: every Loom library carried its own copy of libstdc++'s code
  # (libloom_sdk.so defined 121 std::filesystem functions and needed no libstdc++.so.6), and
  # PluginScan.CrashingExitingAndHangingPluginsAreRefusedByNameAndTheOthersLoad died of SIGSEGV
  # there (docs/gpu.md, "The fourth run"). Such a compiler is passed over for the system's.
  cxx="${CXX:-$(command -v c++ || command -v g++)}"
  if [ -n "$cxx" ] && [ "$("$cxx" -print-file-name=libstdc++.so 2>/dev/null)" = "libstdc++.so" ] && [ -x /usr/bin/g++ ]; then
    echo "[gpu-suite] $cxx links no shared libstdc++: using /usr/bin/g++" >&2
    boost+=(-DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_C_COMPILER=/usr/bin/gcc)
  fi
  run_step configure 10 cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLOOM_PYTHON="$py" "${boost[@]}" || exit 1
fi
run_step build 20 cmake --build "$build_dir" -j "$jobs" || exit 1

# ---- tests --------------------------------------------------------------------------------------
# GPU tests one at a time (one device); the rest of the suite runs last (below), after the
# benchmarks: on a lent machine minutes are scarce, and the rest also runs in CI.
run_step test-gpu 20 ctest --test-dir "$build_dir" -L gpu --output-on-failure --timeout 600 \
  --output-junit "$out/junit/ctest-gpu.xml"

# A fused operation whose GPU test failed or crashed is turned off for the benchmarks, so that a
# faulty new kernel costs its speed-up, not the lent machine's figures (scripts/fused_gate.py).
fused_gate=""
if [ -f "$out/logs/test-gpu.log" ] && [ -z "${LOOM_FUSED_KERNELS+set}" ]; then
  fused_gate="$("$py" "$root/scripts/fused_gate.py" "$out/logs/test-gpu.log" 2>"$out/logs/fused-gate.log")"
  gate_rc=$?
  if [ $gate_rc -ne 0 ] && [ $gate_rc -ne 2 ]; then  # 2: tests missing from the log, counted as failed
    fused_gate=""
    step_rows+=("| fused-gate | **failed** (exit $gate_rc): every fused operation stays on | 0 | logs/fused-gate.log |")
    failures=$((failures + 1))
  elif [ -n "$fused_gate" ]; then
    export LOOM_FUSED_KERNELS="$fused_gate"
    step_rows+=("| fused-gate | **LOOM_FUSED_KERNELS=$fused_gate for the benchmarks**: $(tr '\n' ';' <"$out/logs/fused-gate.log") | 0 | logs/fused-gate.log |")
    [ $gate_rc -eq 2 ] && failures=$((failures + 1))
  else
    step_rows+=("| fused-gate | every fused operation's GPU tests passed (or skipped): all on | 0 | |")
  fi
  cat "$out/logs/fused-gate.log" >&2
fi

# ---- benchmarks ---------------------------------------------------------------------------------
# GPT-2 first: its MFU is the figure issue 14 still misses (docs/gpu.md, "The seventh run").
# GPT-2 124M in bf16 at sequence 1024, tokens/s and MFU against the card's bf16 peak, twice:
# bench-gpt2-large as llm.c trains it (micro-batches of 32 sequences, four per update: 131072
# tokens per step; llm.c's 38 % on an H100 is at 64 x 1024 per micro-batch, 524288 per step), then
# bench-gpt2 at 8 x 1024 tokens per step, where the optimizer and the host's launches weigh
# eight times more per token. The dry run: the debug size on CPU, Loom and PyTorch eager.
if [ $dry_run = 1 ]; then
  run_step bench-gpt2-large 30 "$py" "$root/bench/compare_gpt2.py" --loom "$build_dir/bin/loom" --device cpu \
    --size debug --vocab-size 512 --seq-len 64 --batch-size 4 --accumulation 2 --steps 10 --window 5 \
    --variants loom,pytorch --repeats 1
else
  run_step bench-gpt2-large 60 "$py" "$root/bench/compare_gpt2.py" --loom "$build_dir/bin/loom" --device cuda \
    --size gpt2 --vocab-size 50304 --seq-len 1024 --batch-size 32 --accumulation 4 --steps 16 --window 4 \
    --variants loom_graph,loom,pytorch,pytorch_compile --repeats 1
fi
if [ $dry_run = 1 ]; then
  run_step bench-gpt2 30 "$py" "$root/bench/compare_gpt2.py" --loom "$build_dir/bin/loom" --device cpu \
    --size debug --vocab-size 512 --seq-len 64 --batch-size 4 --steps 20 --window 5 --variants loom,loom_unfused,pytorch --repeats 1
else
  run_step bench-gpt2 60 "$py" "$root/bench/compare_gpt2.py" --loom "$build_dir/bin/loom" --device cuda \
    --size gpt2 --vocab-size 50304 --seq-len 1024 --batch-size 8 --steps 60 --window 10 \
    --variants loom_graph,loom,pytorch,pytorch_compile,loom_unfused --repeats 1
fi
# Each prints its figures (summary.md quotes them whole). On a GPU: the precision table (Loom against the same
# model in PyTorch from the same torch, every precision) and the memory figures; the dry run
# runs them short on the CPU.
# `loom profile` on the device: a Chrome trace with the CUDA kernels and copies beside Loom's
# phases (traces/ in the output), and its tables in the log.
mkdir -p "$out/traces"
if [ $dry_run = 1 ]; then profile_device=cpu; else profile_device=cuda; fi
# One trace per precision (the default job's model on synthetic data at micro-batch 128); the
# tables, with the host's waits for the device per step, go to the log.
profile_all() {
  local p status=0
  local graph=()
  for p in fp32 bf16_amp fp16_amp fp32_graph; do
    # fp32_graph: the step as a CUDA graph (step.cuda_graph), captured in the warm-up steps
    [ "$p" = fp32_graph ] && { [ "$profile_device" = cuda ] || continue; graph=(--set step.cuda_graph=true); }
    echo "== loom profile, precision $p"
    "$build_dir/bin/loom" profile --steps 20 --warmup 5 --set trainer.device=$profile_device \
      --set data.name=synthetic --set data.image_size=28 --set data.train_size=8192 --set data.test_size=256 \
      --set trainer.batch_size=128 --set precision.name=${p%_graph} "${graph[@]}" \
      --trace "$out/traces/loom-profile-$profile_device-$p.json" ||
      status=1
  done
  # GPT-2 as bench-gpt2 trains it (on the CPU: the debug size), so that its MFU comes with a trace
  local gpt2=(--set model.size=gpt2 --set model.vocab_size=50304 --set data.seq_len=1024 --set trainer.batch_size=8
              --set precision.name=bf16_amp)
  [ "$profile_device" = cuda ] || gpt2=(--set model.size=debug --set model.vocab_size=512 --set data.vocab_size=512
                                        --set data.seq_len=64 --set trainer.batch_size=4 --set precision.name=fp32)
  echo "== loom profile, GPT-2"
  "$build_dir/bin/loom" profile --steps 10 --warmup 3 --set trainer.device=$profile_device \
    --set model.name=gpt2_lm --set model.dropout=0.0 --set data.name=synthetic_tokens --set data.train_size=512 \
    --set data.validation_fraction=0 "${gpt2[@]}" --trace "$out/traces/loom-profile-$profile_device-gpt2.json" ||
    status=1
  # its device time by operator and by kernel (Loom's fused kernels under their loom_* names)
  echo "== GPT-2's device time per step"
  "$py" "$root/bench/gpu_kernels.py" "$out/traces/loom-profile-$profile_device-gpt2.json" 10 || status=1
  return $status
}
export -f profile_all
export build_dir out profile_device py root
run_step bench-profile 20 bash -c profile_all
fmnist=""
for d in /usr/share/datasets/fashion-mnist /opt/gpu-deps/usr/share/datasets/fashion-mnist; do
  [ -f "$d/train-images-idx3-ubyte.gz" ] && { fmnist="$d"; break; }
done
# bench-variants: the same job run four ways, each against PyTorch eager (samples/s, peak memory):
# Loom, Loom with CUDA graphs (step.cuda_graph), PyTorch eager and torch.compile from the same torch.
if [ -z "$fmnist" ]; then
  for step in bench-precision bench-variants; do
    step_rows+=("| $step | not run: no Fashion-MNIST (stage it: GPU_EXTRA_DEBS=dataset-fashion-mnist, docs/gpu.md) | 0 | |")
  done
elif [ $dry_run = 1 ]; then
  run_step bench-precision 30 "$py" "$root/bench/compare_fashion_mnist.py" --loom "$build_dir/bin/loom" \
    --data "$fmnist" --device cpu --precisions fp32 --batches 8 --steps 30 --window 10 --repeats 1
  # loom_graph is refused on CPU (the script says it skips it); torch.compile is left out here: it
  # builds C++ kernels with g++, about a minute on the 2-core CI machine with a cold cache.
  run_step bench-variants 30 "$py" "$root/bench/compare_fashion_mnist.py" --loom "$build_dir/bin/loom" \
    --data "$fmnist" --device cpu --precisions fp32 --batches 8 --variants loom,loom_graph,pytorch \
    --steps 30 --window 10 --repeats 1
else
  run_step bench-precision 60 "$py" "$root/bench/compare_fashion_mnist.py" --loom "$build_dir/bin/loom" \
    --data "$fmnist" --device cuda --precisions fp32,tf32,fp16_amp,bf16_amp --batches 128,1024 \
    --steps 300 --window 50 --repeats 1
  run_step bench-variants 60 "$py" "$root/bench/compare_fashion_mnist.py" --loom "$build_dir/bin/loom" \
    --data "$fmnist" --device cuda --precisions fp32,bf16_amp --batches 128 \
    --variants loom,loom_graph,pytorch,pytorch_compile --steps 300 --window 50 --repeats 1
fi
# bench-parallel: single against ddp with a world of one (NCCL) and data_parallel on one GPU (and
# on two where there are two): what each strategy costs per step (the dry run: on the CPU, Gloo).
if [ $dry_run = 1 ]; then
  run_step bench-parallel 30 "$py" "$root/bench/parallel_overhead.py" --loom "$build_dir/bin/loom" --device cpu \
    --steps 40 --window 10 --repeats 1
else
  run_step bench-parallel 60 "$py" "$root/bench/parallel_overhead.py" --loom "$build_dir/bin/loom" --device cuda \
    --steps 300 --window 50 --repeats 2
fi
if [ $dry_run = 1 ]; then
  run_step bench-memory 30 "$build_dir/bin/loom_memory_figures" --device cpu
else
  run_step bench-memory 30 "$build_dir/bin/loom_memory_figures" --device cuda
fi

# ---- the rest of the suite, in parallel, with whatever budget is left ----------------------------
# without the gate's setting: the tests choose their fused operations themselves
[ -n "$fused_gate" ] && unset LOOM_FUSED_KERNELS
run_step test-rest 30 ctest --test-dir "$build_dir" -LE gpu --output-on-failure --timeout 900 -j "$jobs" \
  --output-junit "$out/junit/ctest-rest.xml"

[ $failures -eq 0 ]
