#!/bin/sh
# The "install" test: installs a kernelgraph build into a temporary prefix, configures and builds
# the project in this folder against it (CMAKE_PREFIX_PATH), checks that no program it built
# links libnvrtc or libcuda, and runs each one. Exits 77 (skipped) only when cmake is missing.
#
#   run.sh --cmake=CMAKE --build=BUILD_DIR --source=SOURCE_DIR [--generator=G] [--config=C]
#          [--cxx=CXX] [--cxx-flags=FLAGS] [--linker-flags=FLAGS] [--make-program=PATH] [--keep]
#
# The temporary folder is removed when the test passes and kept (and printed) when it fails, or
# always with --keep.
set -eu

cmake=cmake build='' source='' generator='' config=Release cxx='' cxx_flags='' linker_flags='' make_program='' keep=''
for arg in "$@"; do
  case $arg in
    --cmake=*) cmake=${arg#*=} ;;
    --build=*) build=${arg#*=} ;;
    --source=*) source=${arg#*=} ;;
    --generator=*) generator=${arg#*=} ;;
    --config=*) config=${arg#*=} ;;
    --cxx=*) cxx=${arg#*=} ;;
    --cxx-flags=*) cxx_flags=${arg#*=} ;;
    --linker-flags=*) linker_flags=${arg#*=} ;;
    --make-program=*) make_program=${arg#*=} ;;
    --keep) keep=1 ;;
    *) echo "run.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
if [ -z "$build" ] || [ -z "$source" ]; then
  echo "run.sh: --build and --source are required" >&2
  exit 2
fi
if ! command -v "$cmake" >/dev/null 2>&1; then
  if command -v cmake >/dev/null 2>&1; then
    cmake=$(command -v cmake)
  else
    echo "cmake not found: skipped"
    exit 77
  fi
fi

build=$(cd "$build" && pwd) || exit 2
source=$(cd "$source" && pwd) || exit 2

work=$(mktemp -d "${TMPDIR:-/tmp}/kg-install-test.XXXXXX")
prefix=$work/prefix
fail() {
  echo "FAIL: $*" >&2
  echo "(files kept in $work)" >&2
  exit 1
}

echo "== install $build into $prefix"
"$cmake" --install "$build" --prefix "$prefix" --config "$config" >"$work/install.log" 2>&1 ||
  { cat "$work/install.log"; fail "cmake --install"; }
for f in include/kg/kg.hpp bin/kgraph; do
  [ -e "$prefix/$f" ] || fail "$f was not installed"
done
ls "$prefix"/lib*/libkgraph.a "$prefix"/lib*/cmake/kernelgraph/kernelgraphConfig.cmake \
  "$prefix"/lib*/pkgconfig/kernelgraph.pc >/dev/null || fail "library, CMake package or kernelgraph.pc missing"

echo "== configure and build tests/install against it"
set -- -S "$source/tests/install" -B "$work/build" -DCMAKE_BUILD_TYPE="$config" -DCMAKE_PREFIX_PATH="$prefix" \
  -DKG_EXAMPLE_DIR="$source/examples/detect_decode" -DCMAKE_CXX_FLAGS="$cxx_flags" \
  -DCMAKE_EXE_LINKER_FLAGS="$linker_flags"
[ -n "$generator" ] && set -- "$@" -G "$generator"
[ -n "$cxx" ] && set -- "$@" -DCMAKE_CXX_COMPILER="$cxx"
[ -n "$make_program" ] && set -- "$@" -DCMAKE_MAKE_PROGRAM="$make_program"
"$cmake" "$@" || fail "configuring the project against the installed package"
"$cmake" --build "$work/build" --config "$config" || fail "building the project against the installed package"

# Fresh caches: every kernel is really compiled (NVRTC, the emulator's host compiler).
export KG_CACHE_DIR="$work/cache"
programs=$work/build/programs-$config.txt
[ -s "$programs" ] || fail "no $programs"
while read -r prog; do
  echo "== $prog"
  if command -v readelf >/dev/null 2>&1; then
    if readelf -d "$prog" | grep NEEDED | grep -E 'libnvrtc|libcuda'; then
      fail "$prog links NVRTC or libcuda; both must be opened at run time"
    fi
  fi
  "$prog" </dev/null || fail "$prog exited with $?"
done <"$programs"

if [ -z "$keep" ]; then rm -rf "$work"; else echo "(files kept in $work)"; fi
echo "install test passed"
