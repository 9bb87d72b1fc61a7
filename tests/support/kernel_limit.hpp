// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Runs a test under a limit on the bf16 kernels (gattn::set_bf16_kernel_limit) or the int8
/// decoding kernels (gattn::set_int8_kernel_limit) and lifts the limit when the test ends, pass
/// or fail.

#include "gattn/gattn.hpp"

namespace gattn_test {

/// Sets the bf16 kernel limit for its lifetime; restores the default (AMX) when destroyed.
struct KernelLimit {
    explicit KernelLimit(gattn::Bf16Kernel k) { gattn::set_bf16_kernel_limit(k); }
    ~KernelLimit() { gattn::set_bf16_kernel_limit(gattn::Bf16Kernel::Amx); }
    KernelLimit(const KernelLimit&) = delete;
    KernelLimit& operator=(const KernelLimit&) = delete;
};

/// Sets the int8 decoding kernel limit for its lifetime; restores the default (VNNI) when destroyed.
struct Int8KernelLimit {
    explicit Int8KernelLimit(gattn::Int8Kernel k) { gattn::set_int8_kernel_limit(k); }
    ~Int8KernelLimit() { gattn::set_int8_kernel_limit(gattn::Int8Kernel::Vnni); }
    Int8KernelLimit(const Int8KernelLimit&) = delete;
    Int8KernelLimit& operator=(const Int8KernelLimit&) = delete;
};

}  // namespace gattn_test
