#!/usr/bin/env bash
# Builds gattn's tests, examples and benchmarks and runs the test suite with ctest once per
# flavour, all with -Wall -Wextra -Werror. Instruction-set flavours (g++):
#   baseline  the compiler's default (x86-64: SSE2), the whole suite, at -O2 (CMake's Release
#             is -O3, which the native flavour keeps for test_ops: -O2 compiles in a fifth less
#             time at SSE2 and in half at -march=native);
#   native    -march=native (e.g. AVX-512), the whole suite, test_ops (the kernels) at -O3 and
#             the rest at -O2 (GATTN_LAYER_TESTS_OPTIONS), and the example that a test
#             runs (layer_from_pytorch); the other examples and the benchmarks, which no test
#             runs, are only compiled with -fsyntax-only
#             (GATTN_SYNTAX_ONLY_PROGRAMS): every template they use is checked, in a quarter
#             of the time;
#   avx2      -mavx2 -mfma (x86 only), the tests of the SIMD code paths: kernels, SDPA in every
#             storage type, projections and the shared fault cases (test_ops).
# Clang flavours (clang++, Debian's clang 14 and LLVM's OpenMP runtime libomp):
#   clang  the whole suite, examples and benchmarks, Release;
#   asan   the whole suite under AddressSanitizer + UndefinedBehaviorSanitizer (-O1 with line
#          tables for the reports, assertions on, any report fails the test; UBSan's vptr check
#          is left out: gattn has no class hierarchy to downcast in, and the check costs a tenth
#          of the build), at -mavx2 -mfma
#          where the CPU has AVX2, so that the AVX2 code paths run sanitized; it leaves out the
#          repeats of covered paths at larger sizes (gtest filter in the asan case below);
#   tsan   ThreadSanitizer on test_layer, the tests that run threads (std::thread and OpenMP;
#          libomp's archer tool tells ThreadSanitizer about OpenMP's synchronisation).
# Backend flavour (g++, -march=native at -O1 with assertions, Debian's libdnnl-dev):
#   onednn -DGATTN_WITH_ONEDNN=ON: the backend changes PackedLinear only, so its tests (both
#          backends against a float64 reference) and Qwen3-Next's bf16 layer against PyTorch,
#          with the bf16 projections on oneDNN's matmul.
# ARM64 flavour (Debian's g++-aarch64-linux-gnu, tests under qemu-user; cmake/aarch64-linux-gnu.cmake):
#   aarch64  cross build of test_ops at -O2 (GoogleTest built from /usr/src/googletest): the
#            kernels, SDPA in every storage type with every mask kind, paged and cascade
#            attention, the backward pass, projections and the shared fault cases. The layers,
#            models and readers above them have no ARM-specific code and are left to the x86
#            flavours. scripts/check_arm_vector.sh checks that the kernels' loops are vector
#            code (NEON, SVE), then the tests run under QEMU on two CPU models: max (SVE2 at 512
#            bits, BF16, I8MM, dot product: float decoding runs the SVE kernel, int8 decoding the
#            SDOT one, bf16 decoding the BFDOT one) and cortex-a57 (NEON only: both widen to float; without the sweeps' shapes of 113
#            and 250 queries), plus at a second SVE vector length (256 bits) the instruction-set
#            and CPU feature reports and float decoding with every mask kind, paged and
#            cascade (float decoding runs SVE at both lengths, NEON on cortex-a57). Each
#            model's features are checked against what QEMU was asked for
#            (GATTN_EXPECT_CPU_FEATURES). Under emulation the whole of test_ops takes about
#            6 minutes of CPU per model, so this leaves out (gtest filter aarch64_skip below):
#            the sweeps' largest shape (N = 250, grouped GQA blocks) in double, bf16 and fp16
#            (float keeps it; every mask kind stays at every other shape);
#            NarrowSdpa.DecodingOverLongCacheMatchesReference (bf16 decoding over 1500 and 26000
#            keys; SdpaTyped.DecodeFromMemoryMatchesReference runs the same path for float, the
#            sweeps bf16 decoding with every mask); SdpaProperty (random configurations); the
#            thread-count determinism test SdpaDeterminism.ResultIsBitwiseIndependentOfThreadCount;
#            paged attention in double, fp16 and bf16 (float and int8 run the page-table paths;
#            cortex-a57 runs float only, and not the one-row-per-KV-head decoding from memory);
#            and HugePages.* (qemu-user accepts madvise(MADV_HUGEPAGE) without passing it on to
#            the kernel, so the mappings never carry the flag those tests read back).
# MPI flavour (g++, -march=native at -O1 with assertions, Debian's openmpi-bin and libopenmpi-dev):
#   mpi    -DGATTN_WITH_MPI=ON: gattn/dist's ring attention, head-parallel layers and
#          sharded-cache decoding under mpiexec on 2 and 3 ranks, and the examples/mpi
#          programs on 2 (bench_dist is compiled with -fsyntax-only).
# Compile-only flavour (g++, x86 hosts):
#   compile-x86  the instruction-set tiers this machine's CPU may lack, compiled and linked but
#          not run: the test files that instantiate the AVX512-BF16, AVX512-VNNI and AMX
#          kernels (test_narrow_sdpa, test_int8_kv, test_packed_linear, one executable each) at
#          -march=sapphirerapids (AMX, AVX512-BF16, VNNI) and -march=znver4 (AVX512-BF16, VNNI,
#          no AMX; with g++ 12, which lacks znver4, -march=znver3 plus Zen 4's AVX-512 flags), and
#          test_int8_kv at -march=alderlake (the AVX-VNNI kernel: VEX VPDPWSSD on ymm); then a
#          count of each tier's instructions in the executables (TDPBF16PS, VDPBF16PS,
#          VPDPWSSD), so that a tier compiled out shows as a failure. Their tests run in the
#          native flavour wherever the CPU has the tier; the configuration that equals this
#          CPU's (AVX512-BF16 and VNNI with or without AMX) is left to it. Built at -O1 (the
#          instructions are there at any level): about 70 s on 2 cores with one left to the
#          native flavour, 112 s at -O3.
# Each flavour ends with its counts of GoogleTest cases run, passed, failed and skipped
# (scripts/test_summary.py) and its build and test times.
# Environment: BUILD_DIR (default build/test; flavours go to BUILD_DIR-<flavour>),
# JOBS (default: all cores), FLAVOURS (default "baseline native"; any of those and
# "avx2 clang asan tsan onednn mpi aarch64 compile-x86"), CMAKE_ARGS (extra CMake args).
# The tests/odr units are built with fixed flags, so of the g++ flavours only baseline builds
# them (GATTN_BUILD_ODR_TESTS). baseline, native, avx2 and asan compile each group of test files
# as one unit (GATTN_UNITY_TESTS) and run each test executable as up to 4 ctest tests, one shard
# of its GoogleTest cases each (GATTN_TESTS_PER_EXECUTABLE; CMAKE_ARGS=-DGATTN_TESTS_PER_EXECUTABLE=OFF
# gives one ctest test per GoogleTest case). tsan and onednn build single files' executables
# (GATTN_UNITY_TESTS=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."

# Drops the per-target and per-test progress lines; failures and summaries stay.
quiet() {
  grep -Ev '^\[ *[0-9]+%\] (Building|Linking|Built)|^\[[0-9]+/[0-9]+\] (Building|Linking)|^ +Start +[0-9]+: |Test +#[0-9]+: .* Passed' ||
    true
}

build="${BUILD_DIR:-build/test}"
jobs="${JOBS:-$(nproc)}"
flavours="${FLAVOURS:-baseline native}"
extra_packages=()
case " $flavours " in *" onednn "*) extra_packages+=(libdnnl-dev) ;; esac
case " $flavours " in *" mpi "*) extra_packages+=(openmpi-bin libopenmpi-dev) ;; esac
case " $flavours " in *" aarch64 "*) extra_packages+=(g++-aarch64-linux-gnu qemu-user googletest) ;; esac
case " $flavours " in *" compile-x86 "* | *" onednn "* | *" mpi "*) extra_packages+=(ninja-build) ;; esac
case " $flavours " in
  *" clang "* | *" asan "* | *" tsan "*) scripts/deps.sh clang "${extra_packages[@]}" ;;
  *) scripts/deps.sh test "${extra_packages[@]}" ;;
esac

# The CMake package test builds its consumers with the default compiler and flags, whatever the
# flavour: the baseline flavour runs it, native and asan leave it out.
package_test='^CMakePackage\.'
# compile-x86, onednn and mpi check that code compiles or test what a backend or MPI changes, at
# small sizes: -O1 with assertions compiles in about half the time of Release.
fast_build=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1")

for flavour in $flavours; do
  if [ "$flavour" = compile-x86 ]; then
    flavour_start=$SECONDS
    case "$(uname -m)" in x86_64 | i?86) ;; *) echo "compile-x86: x86 hosts only" >&2; exit 2 ;; esac
    all_targets="test_narrow_sdpa test_int8_kv test_packed_linear"
    # march | instructions that must appear in the executables (the tiers it has) | targets
    # alderlake (AVX2 with AVX-VNNI, no AVX-512): its vpdpwssd can only be the VEX ymm form.
    # g++ 12.2 (Debian bookworm) has no -march=znver4: Zen 3 plus Zen 4's AVX-512 extensions.
    znver4="-march=znver4"
    g++ -march=znver4 -E -x c++ /dev/null >/dev/null 2>&1 ||
      znver4="-march=znver3 -mavx512f -mavx512cd -mavx512bw -mavx512dq -mavx512vl -mavx512ifma -mavx512vbmi \
-mavx512vbmi2 -mavx512bitalg -mavx512vpopcntdq -mavx512vnni -mavx512bf16 -mgfni -mvaes -mvpclmulqdq"
    # The native flavour already builds and runs the tier set of this machine's CPU: a
    # configuration equal to it is not compiled again.
    cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
    has() { for f in "$@"; do [[ "$cpu_flags" == *" $f "* ]] || return 1; done; }
    native_has=none
    if has avx512_bf16 avx512_vnni amx_tile amx_bf16; then native_has=sapphirerapids
    elif has avx512_bf16 avx512_vnni && ! has amx_tile; then native_has=znver4; fi
    for entry in "sapphirerapids|-march=sapphirerapids|tdpbf16ps vdpbf16ps vpdpwssd|$all_targets" \
                 "znver4|$znver4|vdpbf16ps vpdpwssd|$all_targets" "alderlake|-march=alderlake|vpdpwssd|test_int8_kv"; do
      IFS='|' read -r name march needed target_list <<<"$entry"
      read -r -a targets <<<"$target_list"
      if [ "$name" = "$native_has" ]; then
        echo "== compile-x86 $name: left to the native flavour (this CPU has the same tiers, and runs them)"
        continue
      fi
      dir="$build-compile-x86-$name"
      echo "== compile-x86 build (GATTN_ARCH_FLAGS='$march', not run)"
      cmake -S . -B "$dir" "$(scripts/ninja_generator.sh "$dir")" "${fast_build[@]}" -DGATTN_ARCH_FLAGS="$march" -DGATTN_UNITY_TESTS=OFF \
        -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_BUILD_EXAMPLES=OFF -DGATTN_BUILD_ODR_TESTS=OFF ${CMAKE_ARGS:-} >/dev/null
      cmake --build "$dir" -j "$jobs" --target "${targets[@]}" 2>&1 | quiet
      listing=$(for t in "${targets[@]}"; do objdump -d --no-show-raw-insn "$dir/tests/$t"; done)
      for insn in $needed; do
        count=$(grep -c "[[:space:]]$insn[[:space:]]" <<<"$listing" || true)
        echo "   $name: $insn $count"
        [ "$count" -gt 0 ] || { echo "compile-x86: no $insn in the $name build (tier compiled out?)" >&2; exit 1; }
      done
    done
    echo "== compile-x86: build $((SECONDS - flavour_start)) s (not run)"
    continue
  fi
  cmake_args=(-DCMAKE_BUILD_TYPE=Release)
  release_o2=("-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG")
  build_args=()   # empty: every target
  ctest_args=()
  run_env=()
  qemu_cpus=()  # aarch64: "<QEMU_CPU>|<GATTN_EXPECT_CPU_FEATURES>|<gtest filter>" per ctest run
  case "$flavour" in
    baseline)
      arch=""
      cmake_args+=("${release_o2[@]}" -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_BUILD_EXAMPLES=OFF
                   -DGATTN_TESTS_PER_EXECUTABLE=ON)
      ;;
    avx2)
      arch="-mavx2 -mfma"
      cmake_args+=(-DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_BUILD_EXAMPLES=OFF -DGATTN_BUILD_ODR_TESTS=OFF
                   -DGATTN_TESTS_PER_EXECUTABLE=ON -DGATTN_UNITY_TESTS=ON)
      build_args=(--target test_ops)
      ctest_args=(-R "^test_ops\\.")
      ;;
    native)
      arch="-march=native"
      cmake_args+=(-DGATTN_BUILD_ODR_TESTS=OFF -DGATTN_TESTS_PER_EXECUTABLE=ON -DGATTN_SYNTAX_ONLY_PROGRAMS=ON
                   -DGATTN_LAYER_TESTS_OPTIONS=-O2)
      ctest_args=(-E "$package_test")
      ;;
    onednn)
      arch="-march=native"
      cmake_args=("${fast_build[@]}")
      cmake_args+=(-DGATTN_WITH_ONEDNN=ON -DGATTN_BUILD_EXAMPLES=OFF -DGATTN_UNITY_TESTS=OFF)
      # The backend changes PackedLinear only: its tests (both backends against the float64
      # reference), and Qwen3-Next's bf16 layer end to end against PyTorch.
      build_args=(--target test_packed_linear test_qwen3_next)
      ctest_args=(-R "PackedLinear|Bf16")  # PackedLinear*, Qwen3NextBf16*
      ;;
    mpi)
      arch="-march=native"
      cmake_args=("${fast_build[@]}")
      cmake_args+=(-DGATTN_WITH_MPI=ON -DGATTN_SYNTAX_ONLY_PROGRAMS=ON)
      # bench_dist is built, not run; the examples run at small sizes.
      build_args=(--target test_ring_attention test_head_parallel test_sharded_cache bench_dist ring_prefill head_parallel_decode)
      ctest_args=(-R "RingAttention|HeadParallel|ShardedCache|ExamplesMpi")
      ;;
    aarch64)
      arch=""
      cmake_args+=("${release_o2[@]}" -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
                   -DGATTN_GTEST_SOURCE_DIR=/usr/src/googletest -DGATTN_BUILD_BENCHMARKS=OFF
                   -DGATTN_BUILD_EXAMPLES=OFF -DGATTN_TESTS_PER_EXECUTABLE=ON)
      build_args=(--target test_ops)
      aarch64_skip="SdpaProperty.*:NarrowSdpa.DecodingOverLongCacheMatchesReference"
      aarch64_skip+=":ShapesAndMasks/SdpaSweep.DoubleMatchesReference/N250*:ShapesAndMasks/NarrowSweep.*/N250*"
      aarch64_skip+=":SdpaDeterminism.ResultIsBitwiseIndependentOfThreadCount"
      aarch64_skip+=":PagedAttention.Double*:PagedAttention.Half*:PagedAttention.Bf16*:HugePages.*"
      all_features="asimd asimddp sve sve2 bf16 i8mm"
      # The float prefill tiles run the same NEON code on both models; float decoding runs SVE
      # on max (NEON on cortex-a57, and beside SVE in SdpaDecoding); int8 and bf16 decoding
      # dispatch on HWCAP: max runs the SDOT kernel (Int8Sdpa/Sdot) and leaves the widened one
      # (Int8Sdpa/WidenedFloat) to cortex-a57, which has no dot product; max runs bf16 with
      # BFDOT and widened (both in test_narrow_sdpa's lists), cortex-a57 widened only. The second also leaves
      # out the sweeps' shapes of 113 and 250 queries (keys beyond one block stay, in
      # KeysN113Dk128Dv40 and DecodeMqaDk128), and what runs the same code on both models, which
      # max runs (no HWCAP choice inside): the 16-bit sweeps (widened kernel), double, the
      # backward pass and the mixed batch (paged float decoding stays, in its bitwise test).
      qemu_cpus=("max|$all_features sve_bits=512|-$aarch64_skip:Kernels/Int8Sdpa.*/WidenedFloat"
                 "cortex-a57|asimd|-$aarch64_skip:ShapesAndMasks/*/N250*:ShapesAndMasks/*/N113*:ShapesAndMasks/*/QLongerN113*:PagedAttention.Int8*:*DecodeFromMemoryOneRowPerKvHead*:ShapesAndMasks/NarrowSweep.*:ShapesAndMasks/SdpaSweep.Double*:SdpaTyped/Double*:SdpaBackward*:PagedAttention.MixedBatch*"
                 "max,sve-default-vector-length=32|$all_features sve_bits=256|Library.*:SdpaDecoding.*:SdpaTyped/Float*:ShapesAndMasks/SdpaSweep.FloatMatchesReference/*:PagedAttention.Float*:CascadeAttention.*")
      ;;
    clang)
      arch=""
      cmake_args+=(-DCMAKE_CXX_COMPILER=clang++)
      ;;
    asan)
      arch=""
      grep -qw avx2 /proc/cpuinfo 2>/dev/null && arch="-mavx2 -mfma"
      # GATTN_NO_UNROLL: the kernels' loops left to the compiler (same results; the forced
      # unrolling took 40 % more compile time here, where speed does not matter).
      san="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=all -fno-omit-frame-pointer -DGATTN_NO_UNROLL"
      cmake_args=(-DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo
                  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" "-DCMAKE_CXX_FLAGS=$san"
                  "-DCMAKE_EXE_LINKER_FLAGS=$san"
                  -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_BUILD_EXAMPLES=OFF -DGATTN_BUILD_ODR_TESTS=OFF
                  -DGATTN_TESTS_PER_EXECUTABLE=ON)
      ctest_args=(-E "$package_test")
      # Under the sanitizers the test time goes to repeats of covered paths at larger sizes: the
      # sweeps' largest shape (N = 250) in double, bf16 and fp16 (float keeps it; every mask kind
      # stays at every other shape), and paged attention in double, fp16 and bf16 (float and int8
      # run the page-table paths). About 145 s of CPU of 430.
      run_env=(GTEST_FILTER="-ShapesAndMasks/SdpaSweep.DoubleMatchesReference/N250*:ShapesAndMasks/NarrowSweep.*/N250*:PagedAttention.Double*:PagedAttention.Half*:PagedAttention.Bf16*")
      run_env+=(ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1
               UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1)
      ;;
    tsan)
      arch=""
      san="-fsanitize=thread -fno-omit-frame-pointer -DGATTN_NO_UNROLL"
      cmake_args=(-DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo
                  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g" "-DCMAKE_CXX_FLAGS=$san"
                  "-DCMAKE_EXE_LINKER_FLAGS=$san"
                  -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_BUILD_EXAMPLES=OFF -DGATTN_UNITY_TESTS=OFF)
      build_args=(--target test_layer)
      llvm_lib="$(cd "$(clang++ -print-resource-dir)/../.." && pwd)"
      run_env=(TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1
               OMP_TOOL_LIBRARIES="$llvm_lib/libarcher.so" ARCHER_OPTIONS=verbose=0)
      ;;
    *) echo "unknown flavour $flavour" >&2; exit 2 ;;
  esac
  flavour_start=$SECONDS
  echo "== $flavour build (GATTN_ARCH_FLAGS='$arch')"
  generator=()
  # Lists of targets build side by side with Ninja (scripts/ninja_generator.sh says why).
  case "$flavour" in onednn | mpi) generator=("$(scripts/ninja_generator.sh "$build-$flavour")") ;; esac
  cmake -S . -B "$build-$flavour" "${generator[@]}" "${cmake_args[@]}" -DGATTN_ARCH_FLAGS="$arch" ${CMAKE_ARGS:-} >/dev/null
  cmake --build "$build-$flavour" -j "$jobs" "${build_args[@]}" 2>&1 | quiet
  if [ "$flavour" = tsan ]; then
    # Only test_layer is built: select its tests by their suite names.
    [ -f "$llvm_lib/libarcher.so" ] || { echo "libarcher.so not found in $llvm_lib" >&2; exit 1; }
    # Suite lines look like "LayerForward." or "PyTorchFixture/0.  # TypeParam = float"; ctest
    # names typed tests "PyTorchFixture.<test><float>", so the "/0" goes.
    suites=$("$build-$flavour/tests/test_layer" --gtest_list_tests |
             sed -n 's/^\([A-Za-z_][A-Za-z0-9_/]*\)\.\( .*\)\{0,1\}$/\1/p' | sed 's|/[0-9]*$||' |
             sort -u | paste -sd '|')
    ctest_args=(-R "^($suites)\\.")
  fi
  if [ "$flavour" = aarch64 ]; then
    scripts/check_arm_vector.sh "$build-$flavour/tests/test_ops"
    built=$SECONDS
    for run in "${qemu_cpus[@]}"; do
      IFS='|' read -r cpu features filter <<<"$run"
      echo "== aarch64 tests under qemu-aarch64 -cpu $cpu (gtest filter $filter)"
      results="$build-$flavour/tests/gtest_results"
      rm -rf "$results" && mkdir -p "$results"
      # Passive OpenMP waits: spinning threads are slow to emulate, and ctest runs two tests at once.
      QEMU_CPU="$cpu" GATTN_EXPECT_CPU_FEATURES="$features" GTEST_FILTER="$filter" OMP_WAIT_POLICY=passive \
        ctest --test-dir "$build-$flavour" -j "$jobs" --output-on-failure --no-tests=error \
        --output-junit "$PWD/$build-$flavour/ctest_junit.xml" -R "^test_ops\\." 2>&1 | quiet
      python3 scripts/test_summary.py "aarch64 -cpu $cpu" "$build-$flavour/ctest_junit.xml" "$results"
    done
    echo "== $flavour: build $((built - flavour_start)) s, tests $((SECONDS - built)) s"
    continue
  fi
  built=$SECONDS
  # --no-tests=error: a filter that selects nothing fails instead of passing. The summary counts
  # GoogleTest cases (tests/CMakeLists.txt: each shard writes its XML report) before the status
  # of ctest ends the script.
  results="$build-$flavour/tests/gtest_results"
  rm -rf "$results" && mkdir -p "$results"
  status=0
  env "${run_env[@]}" ctest --test-dir "$build-$flavour" -j "$jobs" --output-on-failure --no-tests=error \
    --output-junit "$PWD/$build-$flavour/ctest_junit.xml" "${ctest_args[@]}" 2>&1 | quiet || status=$?
  [ -f "$build-$flavour/ctest_junit.xml" ] &&
    python3 scripts/test_summary.py "$flavour" "$build-$flavour/ctest_junit.xml" "$results"
  echo "== $flavour: build $((built - flavour_start)) s, tests $((SECONDS - built)) s"
  [ "$status" -eq 0 ] || exit "$status"
done
