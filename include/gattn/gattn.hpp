// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Umbrella header: everything public in gattn except the safetensors reader
/// (gattn/io/safetensors.hpp, which needs nlohmann_json).

#include "gattn/config.hpp"
#include "gattn/errors.hpp"
#include "gattn/gates/gate_apply.hpp"
#include "gattn/gates/gate_spec.hpp"
#include "gattn/layers/attention_config.hpp"
#include "gattn/layers/gated_multi_head_attention.hpp"
#include "gattn/ops/mask.hpp"
#include "gattn/ops/sdpa.hpp"
#include "gattn/simd/math.hpp"
#include "gattn/types.hpp"
#include "gattn/version.hpp"
