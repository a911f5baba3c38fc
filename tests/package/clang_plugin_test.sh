#!/usr/bin/env bash
# A plugin built with another compiler than Loom: Debian's clang++ against the same libstdc++ (the
# Itanium C++ ABI both follow), out of tree against the installed SDK, must load into the
# gcc-built Loom and train (docs/abi.md, Note [Fingerprint]: the compiler is recorded, not compared).
#   clang_plugin_test.sh <build dir> <source dir> <loom executable> <Torch_DIR of the build>
set -euo pipefail
build="$1" source="$2" loom="$3" torch_dir="$4"
clang="$(command -v clang++-14 || command -v clang++ || true)"
if [ -z "$clang" ]; then echo "no clang++ on this machine (scripts/setup.sh installs clang-14)"; exit 77; fi
work="$(mktemp -d "${TMPDIR:-/tmp}/loom-clang.XXXXXX")"
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

echo "--- install the SDK, build examples/third_party_plugin's mlp_classifier with $clang"
cmake --install "$build" --component sdk --prefix "$work/prefix" >/dev/null
cmake -S "$source/examples/third_party_plugin" -B "$work/example" -G Ninja -DCMAKE_CXX_COMPILER="$clang" \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DTorch_DIR="$torch_dir" \
  -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >"$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; fail "configure with clang failed"; }
cmake --build "$work/example" --target loom_model_mlp_classifier >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; fail "build with clang failed"; }
plugin="$work/example/libloom_model_mlp_classifier.so"
readelf -p .comment "$plugin" | grep -q clang || fail "the plugin was not compiled by clang"

out="$("$loom" plugins inspect "$plugin")" || { echo "$out"; fail "the gcc-built Loom refuses the clang-built plugin"; }
echo "$out" | grep -E "compiler|status"
grep -qE "compiler +clang" <<<"$out" || fail "the fingerprint does not name clang"
"$loom" doctor | grep -E "compiler" || true

echo "--- train with it"
out="$("$loom" train --plugin-dir "$work/example" --set model.name=mlp_classifier --set data.name=synthetic \
  --set trainer.max_steps=40 --set trainer.batch_size=32 --set trainer.device=cpu --set precision.name=fp32 \
  --set trainer.work_dir="$work/runs" --set trainer.name=clang 2>&1)" || { echo "$out"; fail "the run failed"; }
echo "$out" | grep -E "model|test step|done" | head -5
grep -qE "test step 40: loss [0-9.]+, accuracy [0-9.]+ %" <<<"$out" || fail "no test evaluation"
echo "clang plugin test passed"
