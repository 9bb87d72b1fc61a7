# Warning and instruction-set flags for gattn's own tests, benchmarks and examples.
# Never applied to the gattn::gattn target that users link.
function(gattn_project_options target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Werror)
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      # g++ 12's own AVX-512 headers trip this warning on trivial Eigen/xsimd code.
      target_compile_options(${target} PRIVATE -Wno-maybe-uninitialized)
    endif()
  endif()
  if(GATTN_ARCH_FLAGS)
    separate_arguments(_gattn_arch UNIX_COMMAND "${GATTN_ARCH_FLAGS}")
    target_compile_options(${target} PRIVATE ${_gattn_arch})
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      # ...and its _mm512_undefined_* helpers (`__Y = __Y`) trip -Wuninitialized under AVX-512.
      target_compile_options(${target} PRIVATE -Wno-uninitialized)
    endif()
  endif()
endfunction()
