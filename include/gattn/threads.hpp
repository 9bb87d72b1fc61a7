// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// How many threads gattn's parallel work uses: SDPA's tasks, the projections, the gate pass
/// (and oneDNN's matmul when that backend is built in). gattn runs on OpenMP's threads, so this
/// is OpenMP's setting for parallel regions started by the calling thread (the environment
/// variable OMP_NUM_THREADS sets its initial value). Built without OpenMP, gattn runs on the
/// calling thread alone. Results never depend on the thread count.

#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gattn/config.hpp"
#include "gattn/errors.hpp"

namespace gattn {

/// Whether this translation unit was compiled with OpenMP (else gattn uses one thread).
inline constexpr bool compiled_with_openmp() noexcept {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
}

/// Threads the next gattn call from this thread may use (1 without OpenMP).
inline int num_threads() noexcept {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/// Sets the threads of gattn calls made from this thread afterwards (omp_set_num_threads).
/// \throws std::invalid_argument for threads < 1. Without OpenMP, any count runs on one thread.
inline void set_num_threads(int threads) {
    if (threads < 1)
        detail::throw_invalid("gattn::set_num_threads", "threads", "must be >= 1, got " + std::to_string(threads));
#ifdef _OPENMP
    omp_set_num_threads(threads);
#endif
}

}  // namespace gattn
