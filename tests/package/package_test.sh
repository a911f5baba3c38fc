#!/usr/bin/env bash
# The SDK package, as a plugin author uses it: install the SDK to a temporary prefix, build
# examples/third_party_plugin there with find_package(LoomSDK), load it with the CLI, and check
# that the plugin exports only its entry point and needs nothing of the host.
#   package_test.sh <build dir> <source dir> <loom executable> <Torch_DIR of the build>
set -euo pipefail
build="$1" source="$2" loom="$3" torch_dir="$4"
work="$(mktemp -d "${TMPDIR:-/tmp}/loom-package.XXXXXX")"
trap 'rm -rf "$work"' EXIT

step() { echo "--- $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

step "install the SDK to $work/prefix"
cmake --install "$build" --component sdk --prefix "$work/prefix" >/dev/null
test -f "$work/prefix/lib/cmake/LoomSDK/LoomSDKConfig.cmake" || fail "no LoomSDKConfig.cmake installed"
test -f "$work/prefix/include/loom/sdk/abi.h" || fail "no abi.h installed"
if grep -rlE '#include <(boost|spdlog|fmt|nlohmann)/' "$work/prefix/include"; then
  fail "an installed SDK header includes Boost, spdlog, fmt or nlohmann-json"
fi

step "abi.h is plain C"
echo '#include <loom/sdk/abi.h>
int main(void) { loom_plugin_descriptor d; (void)d; return 0; }' > "$work/c_check.c"
cc -std=c11 -Wall -Werror -pedantic -fsyntax-only -I"$work/prefix/include" "$work/c_check.c" || fail "abi.h does not compile as C11"

step "configure and build the installed example against the installed SDK, as docs/writing-a-plugin.md says"
# (only the prefix: the SDK takes the LibTorch it was built with, $torch_dir, with no LOOM_PYTHON or venv said)
example="$work/prefix/share/loom/examples/third_party_plugin"
test -f "$example/CMakeLists.txt" || fail "the example is not installed"
env -u LOOM_PYTHON -u LOOM_VENV -u Torch_DIR cmake -S "$example" -B "$work/example" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >"$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; fail "configure failed"; }
grep -qF "the LibTorch this SDK was built with ($torch_dir)" "$work/configure.log" \
  || { cat "$work/configure.log"; fail "the SDK did not take the LibTorch it was built with"; }
cmake --build "$work/example" >"$work/build.log" 2>&1 || { cat "$work/build.log"; fail "build failed"; }
for plugin in libloom_model_mlp_classifier.so libloom_regression.so libloom_memory_micro_batch_cap.so \
              libloom_callback_divergence_guard.so; do
  plugin="$work/example/$plugin"
  test -f "$plugin" || fail "no $plugin"
  step "$(basename "$plugin") exports only its entry point and needs nothing of the host"
  exported="$(nm -D --defined-only "$plugin" | awk '{print $3}' | sort -u)"
  echo "$exported"
  [ "$exported" = "loom_plugin_entry_v1" ] || fail "exports more than loom_plugin_entry_v1"
  if nm -DC --undefined-only "$plugin" | grep -E 'boost::|spdlog::|fmt::'; then
    fail "the plugin needs Boost, spdlog or fmt symbols"
  fi
  if readelf -d "$plugin" | grep NEEDED | grep -iE 'boost|spdlog|fmt|loom' | grep -v 'libloom_sdk\.so\.'; then
    fail "the plugin links a host library (libloom_sdk, the SDK's type info, is the one it may)"
  fi
  readelf -d "$plugin" | grep NEEDED | grep -q 'libloom_sdk\.so\.0\.1' || fail "the plugin does not link libloom_sdk.so.0.1"
  readelf -n "$plugin" | grep -q 'Loom' || fail "the plugin has no Loom fingerprint note"
  "$loom" plugins inspect "$plugin" | grep -q "status: *accepted" || fail "inspect does not accept $plugin"
  check="$("$loom" plugins check "$plugin" 2>&1)" || { echo "$check"; fail "$plugin does not pass loom plugins check"; }
  echo "$check" | tail -1
done

step "the model docs/writing-a-plugin.md gives whole builds from the page, as written, and conforms"
doc="$source/docs/writing-a-plugin.md"
mkdir -p "$work/doc_model"
awk '/^```cpp$/ { getline l; if (l ~ /^\/\/ my_model\.cpp/) { f = 1; print l; next } } f && /^```$/ { f = 0 } f' "$doc" \
  > "$work/doc_model/my_model.cpp"
# (the first such block: the C tier's, further down, starts the same way)
awk '/^```cmake$/ { getline l; if (l ~ /^cmake_minimum_required/) { f = 1; print l; next } } f && /^```$/ { exit } f' "$doc" \
  > "$work/doc_model/CMakeLists.txt"
grep -q 'LOOM_PLUGIN("my_model"' "$work/doc_model/my_model.cpp" || fail "no whole model found in $doc"
env -u LOOM_PYTHON -u LOOM_VENV -u Torch_DIR cmake -S "$work/doc_model" -B "$work/doc_model/build" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >"$work/doc_configure.log" 2>&1 \
  || { cat "$work/doc_configure.log"; fail "the page's CMakeLists.txt does not configure"; }
cmake --build "$work/doc_model/build" >"$work/doc_build.log" 2>&1 || { cat "$work/doc_build.log"; fail "the page's model does not build"; }
check="$("$loom" plugins check "$work/doc_model/build/libloom_model_my_model.so" 2>&1)" \
  || { echo "$check"; fail "the page's model does not pass loom plugins check"; }
echo "$check" | tail -1

step "the CLI loads and lists them"
out="$("$loom" plugins --plugin-dir "$work/example")"
echo "$out"
for row in 'model +mlp_classifier +1\.0\.0 +libloom_model_mlp_classifier\.so' \
           'dataset +sine_regression +1\.0\.0 +libloom_regression\.so' \
           'model +mlp_regressor +1\.0\.0 +libloom_regression\.so' \
           'memory +micro_batch_cap +1\.0\.0 +libloom_memory_micro_batch_cap\.so' \
           'callback +divergence_guard +1\.0\.0 +libloom_callback_divergence_guard\.so'; do
  echo "$out" | grep -E "^$row" >/dev/null || fail "loom plugins does not list: $row"
done

step "a run with the out-of-tree dataset, model and memory policy"
out="$("$loom" train --plugin-dir "$work/example" --set data.name=sine_regression --set model.name=mlp_regressor \
  --set memory.policies=micro_batch_cap --set memory.max=16 --set trainer.batch_size=64 \
  --set trainer.max_steps=60 --set trainer.eval_every=30 --set trainer.device=cpu --set precision.name=fp32 \
  --set trainer.work_dir="$work/runs" --set trainer.name=regression 2>&1)" || { echo "$out"; fail "the run failed"; }
echo "$out" | grep -E "plan|validation step|test step|done"
grep -qE "plan: 64 = 64 x 1 x 1 -> 16 x 4 x 1 \(micro_batch_cap" <<<"$out" || fail "the policy did not split the batch"
grep -qE "test step 60: loss [0-9.]+, MAE [0-9.]+, MSE [0-9.]+" <<<"$out" || fail "no test evaluation with MSE and MAE"
test -f "$work/runs/regression/checkpoints/best_mse.safetensors" || fail "no best_mse.safetensors (best_metric auto: the first metric)"
step "a run that the out-of-tree callback stops"
# factor 1: any logged loss above the lowest so far counts as diverging, so it stops early.
out="$("$loom" train --plugin-dir "$work/example" --set data.name=sine_regression --set model.name=mlp_regressor \
  --set trainer.callbacks="jsonl, checkpoint, divergence_guard" --set callback.divergence_guard.factor=1 \
  --set callback.divergence_guard.grace=1 --set trainer.log_every=1 --set trainer.batch_size=64 \
  --set trainer.max_steps=200 --set trainer.device=cpu --set precision.name=fp32 \
  --set trainer.work_dir="$work/runs" --set trainer.name=guarded 2>&1)" || { echo "$out"; fail "the guarded run failed"; }
echo "$out" | grep -E "divergence_guard|stopped|done"
stop="$(echo "$out" | sed -nE 's/.*stopped +early at step ([0-9]+) of [0-9]+: divergence_guard: .*/\1/p')"
[ -n "$stop" ] && [ "$stop" -lt 200 ] || fail "divergence_guard did not stop the run"
test -d "$work/runs/guarded/checkpoints/$(printf 'step_%08d' "$stop")" || fail "no checkpoint of step $stop, where it stopped"
step "while the SDK is 0.x, find_package(LoomSDK 0.minor) finds only that minor"
mkdir -p "$work/version_check"
printf 'cmake_minimum_required(VERSION 3.25)\nproject(v LANGUAGES C)\nfind_package(LoomSDK ${WANT} REQUIRED COMPONENTS c)\n' \
  > "$work/version_check/CMakeLists.txt"
cmake -S "$work/version_check" -B "$work/version_check/ok" -DWANT=0.1 -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null 2>&1 \
  || fail "find_package(LoomSDK 0.1) does not find SDK 0.1"
if out="$(cmake -S "$work/version_check" -B "$work/version_check/old" -DWANT=0.0 -DCMAKE_PREFIX_PATH="$work/prefix" 2>&1)"; then
  fail "find_package(LoomSDK 0.0) accepted SDK 0.1: 0.x minors change the interfaces"
fi
echo "$out" | grep -E "version: 0\.1|not compatible" | head -2

step "the C tier: c_plugin.h is plain C99"
echo '#include <loom/sdk/c_plugin.h>
int main(void) { loom_c_dataset d; (void)d; return 0; }' > "$work/c99_check.c"
cc -std=c99 -Wall -Wextra -Werror -pedantic -fsyntax-only -I"$work/prefix/include" "$work/c99_check.c" \
  || fail "c_plugin.h does not compile as C99"

step "build examples/c_dataset with a C compiler alone, no LibTorch anywhere"
LOOM_PYTHON=/nonexistent cmake -S "$source/examples/c_dataset" -B "$work/c_dataset" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_C_COMPILER_LAUNCHER="$(command -v ccache || true)" \
  >"$work/c_configure.log" 2>&1 || { cat "$work/c_configure.log"; fail "configure of the C example failed"; }
cmake --build "$work/c_dataset" >"$work/c_build.log" 2>&1 || { cat "$work/c_build.log"; fail "build of the C example failed"; }
c_plugin="$work/c_dataset/libloom_dataset_c_fashion_mnist.so"
test -f "$c_plugin" || fail "no $c_plugin"
needed="$(readelf -d "$c_plugin" | grep NEEDED)"
echo "$needed"
if echo "$needed" | grep -iE 'torch|c10|stdc\+\+|loom'; then fail "the C plugin needs LibTorch, libstdc++ or Loom"; fi
[ "$(nm -D --defined-only "$c_plugin" | awk '{print $3}' | sort -u)" = "loom_plugin_entry_v1" ] || fail "the C plugin exports more than its entry point"
out="$("$loom" plugins inspect "$c_plugin")" || { echo "$out"; fail "inspect does not accept the C plugin"; }
echo "$out" | grep -E "tier|status|C interface"
grep -qE "tier +c$" <<<"$out" || fail "the C plugin's fingerprint does not say tier c"
grep -q "libtorch" <<<"$out" && fail "the C plugin's fingerprint names a LibTorch"
check="$("$loom" plugins check "$c_plugin" 2>&1)" || { echo "$check"; fail "the C plugin does not pass loom plugins check"; }
echo "$check" | tail -1
if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  step "a run on the C dataset"
  out="$("$loom" train --plugin-dir "$work/c_dataset" --set data.name=c_fashion_mnist --set data.limit_train=2048 \
    --set data.limit_test=512 --set model.flavour=debug --set trainer.max_steps=30 --set trainer.batch_size=32 \
    --set trainer.device=cpu --set precision.name=fp32 --set trainer.work_dir="$work/runs" --set trainer.name=c_data 2>&1)" \
    || { echo "$out"; fail "the run on the C dataset failed"; }
  echo "$out" | grep -E "Fashion-MNIST \(C tier\)|test step"
  grep -qE "test step 30: loss [0-9.]+, accuracy [0-9.]+ %" <<<"$out" || fail "no test evaluation on the C dataset"
fi

echo "package test passed"
