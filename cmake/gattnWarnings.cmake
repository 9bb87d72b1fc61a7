# Warning and instruction-set flags for gattn's own tests, benchmarks and examples.
# Never applied to the gattn::gattn target that users link.
function(gattn_project_options target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Werror)
  endif()
  if(GATTN_ARCH_FLAGS)
    separate_arguments(_gattn_arch UNIX_COMMAND "${GATTN_ARCH_FLAGS}")
    target_compile_options(${target} PRIVATE ${_gattn_arch})
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND
       GATTN_ARCH_FLAGS MATCHES "native|avx512|x86-64-v4|sapphirerapids|graniterapids|emeraldrapids|znver[45]")
      # g++ 12's own AVX-512 headers trip these warnings on trivial Eigen/xsimd code (their
      # _mm512_undefined_* helpers read `__Y = __Y`). Only there (-march=native, -mavx512* and
      # the AVX-512 CPUs that scripts/test.sh's compile-x86 flavour builds for): the baseline
      # and AVX2 builds keep them, for gattn's own code.
      target_compile_options(${target} PRIVATE -Wno-uninitialized -Wno-maybe-uninitialized)
    endif()
  endif()
endfunction()

# A program of gattn's that no test runs (a benchmark, an example): an executable, or with
# GATTN_SYNTAX_ONLY_PROGRAMS only compiled with -fsyntax-only (every template it uses is
# instantiated and checked, no code is generated), as scripts/test.sh does to keep the test
# build short. Extra arguments are its source files.
function(gattn_add_program target)
  if(GATTN_SYNTAX_ONLY_PROGRAMS)
    add_library(${target} OBJECT ${ARGN})
    target_compile_options(${target} PRIVATE -fsyntax-only)
  else()
    add_executable(${target} ${ARGN})
  endif()
  gattn_project_options(${target})
endfunction()
