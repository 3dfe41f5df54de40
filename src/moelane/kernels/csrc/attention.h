// The compiled decode step's attention over a pool of KV caches, read in place (attention.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace moelane {

// q [N, Hq, D], k_pool [S, Hkv, C, D], v_pool [S, Hkv, C, Dv], slots [N], mask [N, L] (L <= C), sinks [Hq] or none
// -> [N, Hq, Dv] in the pools' dtype.
at::Tensor attend_cache(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& slots, const at::Tensor& mask,
                        const std::optional<at::Tensor>& sinks, double scale);

}  // namespace moelane
