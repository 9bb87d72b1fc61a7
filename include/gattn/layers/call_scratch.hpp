// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Scratch matrices for one layer call's activations (projections, gate logits, attention
/// output), kept by the calling thread between calls.
///
/// Allocated afresh in every call, buffers near glibc's mmap threshold (128 KiB at first,
/// then moving) were returned to the kernel when freed and faulted in again in the next call,
/// depending on what else was on the heap: the demo layer's gated forward (128 rows of 256
/// features) took 1.9 ms where 0.5 ms is its arithmetic (AMD EPYC Zen 5, one process,
/// examples/layer_from_pytorch with and without glibc.malloc tunables that stop the trimming).

#include <cstddef>

#include "gattn/config.hpp"
#include "gattn/types.hpp"

GATTN_BEGIN_ISA_NAMESPACE
namespace detail {

/// Largest buffer a thread keeps per slot between calls. Larger calls allocate their own for
/// the call (their arithmetic dwarfs the page faults), so that a long prefill's buffers are
/// not held for the thread's lifetime.
inline constexpr std::size_t kKeptScratchBytes = std::size_t(4) << 20;

/// A [rows, cols] matrix of T for one call: slot `Slot` of the calling thread's kept buffers
/// (grown only, up to kKeptScratchBytes), or a buffer of the call's own above that. Its values
/// are unspecified until written. A slot serves one matrix at a time: a function that holds
/// slot s must not call one that takes it (the layers' forward passes hold them for the call
/// and call no other layer).
template <class T, int Slot>
class CallScratch {
public:
    CallScratch(Index rows, Index cols) : m_rows(rows), m_cols(cols) {
        const Index n = rows * cols;
        if (static_cast<std::size_t>(n) * sizeof(T) <= kKeptScratchBytes) {
            thread_local Vector<T> kept;
            if (kept.size() < n) kept.resize(n);
            m_data = kept.data();
        } else {
            m_own.resize(n);
            m_data = m_own.data();
        }
    }
    CallScratch(const CallScratch&) = delete;
    CallScratch& operator=(const CallScratch&) = delete;

    /// The matrix, row-major [rows, cols], rows packed.
    Eigen::Map<RowMatrix<T>> matrix() noexcept { return {m_data, m_rows, m_cols}; }

private:
    Index m_rows, m_cols;
    Vector<T> m_own;
    T* m_data = nullptr;
};

}  // namespace detail
GATTN_END_ISA_NAMESPACE
