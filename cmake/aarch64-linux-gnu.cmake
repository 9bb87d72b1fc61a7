# Cross build for ARM64 Linux with Debian's cross compiler, tests run under QEMU:
#   apt-get install g++-aarch64-linux-gnu qemu-user googletest
#   cmake -S . -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
#         -DGATTN_GTEST_SOURCE_DIR=/usr/src/googletest -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_BUILD_EXAMPLES=OFF
#   cmake --build build/aarch64 -j2 --target test_ops
#   QEMU_CPU=max ctest --test-dir build/aarch64 -R test_ops
# ctest starts each test through CMAKE_CROSSCOMPILING_EMULATOR; QEMU_CPU chooses the CPU model
# QEMU emulates (max: SVE2, BF16, I8MM, dot product; cortex-a57: NEON only).
# Eigen, xsimd and nlohmann_json are header-only: the host's packages serve (their headers are
# searched after the cross compiler's own, so that the host's C library headers never are).
# GoogleTest has no ARM64 library in Debian's host packages: build it from its sources with
# GATTN_GTEST_SOURCE_DIR. OpenMP is the cross compiler's libgomp.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)

# Libraries only from the target's tree; headers and CMake packages from both.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# /usr/include last: the compiler then reports it as one of its own directories, and CMake drops
# the -isystem /usr/include that xsimd's and nlohmann_json's targets would otherwise add ahead of
# the ARM64 C library's headers.
set(CMAKE_CXX_FLAGS_INIT "-idirafter /usr/include")
# Debian installs xsimd's CMake package under the host's multiarch directory.
set(xsimd_DIR /usr/lib/${CMAKE_HOST_SYSTEM_PROCESSOR}-linux-gnu/cmake/xsimd CACHE PATH "xsimd's CMake package")
