// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Umbrella header: everything public in gattn except the file readers under gattn/io/
/// (safetensors.hpp, hf_checkpoint.hpp), which need nlohmann_json.

#include "gattn/cache/huge_pages.hpp"
#include "gattn/cache/kv_cache.hpp"
#include "gattn/cache/page_table.hpp"
#include "gattn/cache/paged_kv_pool.hpp"
#include "gattn/cache/paged_kv_pool_set.hpp"
#include "gattn/config.hpp"
#include "gattn/errors.hpp"
#include "gattn/gates/gate_apply.hpp"
#include "gattn/gates/gate_spec.hpp"
#include "gattn/layers/attention_config.hpp"
#include "gattn/layers/attention_shard.hpp"
#include "gattn/layers/gated_multi_head_attention.hpp"
#include "gattn/layers/head_shard.hpp"
#include "gattn/models/qwen3_next_attention.hpp"
#include "gattn/models/qwen3_next_training.hpp"
#include "gattn/ops/cascade_sdpa.hpp"
#include "gattn/ops/linear.hpp"
#include "gattn/ops/mask.hpp"
#include "gattn/ops/packed_linear.hpp"
#include "gattn/ops/paged_sdpa.hpp"
#include "gattn/ops/rms_norm.hpp"
#include "gattn/ops/rope.hpp"
#include "gattn/ops/sdpa.hpp"
#include "gattn/ops/sdpa_backward.hpp"
#include "gattn/simd/cpu.hpp"
#include "gattn/simd/math.hpp"
#include "gattn/threads.hpp"
#include "gattn/types.hpp"
#include "gattn/version.hpp"
