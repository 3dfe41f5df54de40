// The compiled decode step's attention over a pool of KV caches, read in place (attention.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>

namespace moelane {

// q [N, Hq, D], k_pool [S, Hkv, C, D], v_pool [S, Hkv, C, Dv], slots [N], mask [N, L] (L <= C), sinks [Hq] or none
// -> [N, Hq, Dv] in the pools' dtype.
torch::Tensor attend_cache(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& slots, const torch::Tensor& mask,
                           const std::optional<torch::Tensor>& sinks, double scale);

}  // namespace moelane
