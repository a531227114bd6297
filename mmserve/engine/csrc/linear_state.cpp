// Gated DeltaNet's recurrent rule (Qwen3.5's linear-attention layers) for one token of each of B requests, in
// place on their states in the engine's state pool.
//
// transformers' `torch_recurrent_gated_delta_rule` does, per request and value head, over the state S (Dk, Dv):
//   S = S * exp(g);  kv = sum_i S[i] * k[i];  delta = (v - kv) * beta;  S = S + k[i] * delta;  o = sum_i S[i] * q[i]
// as about ten tensor ops, each a pass over every state (and the engine gathers the states out of the pool
// before and scatters them back after): ~8 passes over 1 MiB per request and layer for Qwen3.5-0.8B. Here each
// (request, head) state is read once, decayed and updated in place in two sweeps while it sits in the cache.
//
// The arithmetic is transformers', rounding for rounding (products and sums in float32, no fused multiply-add:
// -ffp-contract=off); the two sums over the key dimension add in the order of torch's CPU sum over a
// non-innermost dimension (aten/src/ATen/native/cpu/SumKernel.cpp, `multi_row_sum`): rows in blocks of 16, each
// block summed in order from zero, the blocks' sums added in order to a total from zero. That is torch's order
// for a reduced length below 256 and a value dimension it vectorizes (64 and more, as in every Qwen3.5), so the
// states and outputs are bitwise transformers' there; elsewhere they are within float rounding of it.
// q and k come l2-normalized and q scaled, decay already exp(g), all float32, from the caller (the same torch
// ops transformers runs before its loop).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kSumBlock = 16;  // torch's multi_row_sum level step for reduced lengths below 256

void gated_delta_one(float* s, const float* q, const float* k, const float* v, float decay, float beta,
                     float* out, int64_t dk, int64_t dv, float* total, float* block) {
  // sweep 1: decay every row in place, and sum its products with k
  std::fill(total, total + dv, 0.f);
  for (int64_t b0 = 0; b0 < dk; b0 += kSumBlock) {
    std::fill(block, block + dv, 0.f);
    const int64_t b1 = std::min(b0 + kSumBlock, dk);
    for (int64_t i = b0; i < b1; ++i) {
      float* row = s + i * dv;
      const float ki = k[i];
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        const float x = row[j] * decay;
        row[j] = x;
        block[j] += x * ki;
      }
    }
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) total[j] += block[j];
  }
  // delta, into `total`'s place
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) total[j] = (v[j] - total[j]) * beta;
  // sweep 2: add k[i] * delta to every row, and sum its products with q
  std::fill(out, out + dv, 0.f);
  for (int64_t b0 = 0; b0 < dk; b0 += kSumBlock) {
    std::fill(block, block + dv, 0.f);
    const int64_t b1 = std::min(b0 + kSumBlock, dk);
    for (int64_t i = b0; i < b1; ++i) {
      float* row = s + i * dv;
      const float ki = k[i], qi = q[i];
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        const float x = row[j] + ki * total[j];
        row[j] = x;
        block[j] += x * qi;
      }
    }
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) out[j] += block[j];
  }
}

// state (S, H, Dk, Dv) f32, the pool's rows; slots (B,) int64; q, k (B, H, Dk), v (B, H, Dv), decay, beta (B, H), all
// f32 contiguous. Updates the B states in place; returns the outputs (B, H, Dv) f32.
torch::Tensor gated_delta_step_(torch::Tensor state, torch::Tensor slots, torch::Tensor q, torch::Tensor k,
                                torch::Tensor v, torch::Tensor decay, torch::Tensor beta) {
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == torch::kFloat && state.is_contiguous(),
              "gated_delta_step_: state must be contiguous float32 (slots, heads, Dk, Dv)");
  const int64_t num_slots = state.size(0), h = state.size(1), dk = state.size(2), dv = state.size(3);
  const int64_t b = slots.numel();
  for (const auto& t : {q, k, v, decay, beta}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.size(0) == b && t.size(1) == h,
                "gated_delta_step_: q, k, v, decay and beta must be contiguous float32 with (B, H) leading");
  }
  TORCH_CHECK(q.size(2) == dk && k.size(2) == dk && v.size(2) == dv, "gated_delta_step_: head sizes differ");
  auto slot_ids = slots.to(torch::kLong).contiguous();
  const int64_t* sid = slot_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(sid[i] >= 0 && sid[i] < num_slots, "gated_delta_step_: slot ", sid[i], " out of range");
  }
  auto out = torch::empty({b, h, dv}, q.options());
  float* sp = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * dv);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / h, head = t % h;
      float* s = sp + ((sid[r] * h + head) * dk) * dv;
      gated_delta_one(s, qp + t * dk, kp + t * dk, vp + t * dv, dp[t], bp[t], op + t * dv, dk, dv,
                      scratch.data(), scratch.data() + dv);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mmserve_cpu, m) {
  m.def(
      "gated_delta_step_(Tensor(a!) state, Tensor slots, Tensor q, Tensor k, Tensor v, Tensor decay, "
      "Tensor beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) { m.impl("gated_delta_step_", &gated_delta_step_); }
