// Every fused decoder layer of a pure decode step, in one call (`fused_layers.DecodeStack`).
//
// With the kernels of cpu_ops.cpp and decode_attention.cpp, a decode step's layer in Python was still about 25
// op calls, each with its Python and dispatcher overhead, and a module call per linear layer: at one row 4-5 ms
// of a 51 ms step. This op runs the same ops in the same order from C++, layer after layer: the input RMSNorm
// (with the previous layer's residual add, as add_rms_norm does it: the eager add bit for bit), the q/k/v GEMM,
// RoPE over q and k, the pool write, the decode attention, the output GEMM, the residual add with the
// post-attention RMSNorm, the gate/up GEMM, SiLU-and-mul and the down GEMM. The GEMMs are oneDNN's packed ones
// (`mkldnn::_linear_pointwise`, as PackedLinear calls them) or `at::linear` for weights left unpacked, so the
// result is bitwise the Python layers'.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace mmserve_cpu_ops;

// The ops this layer chains, looked up once in torch's registry (they are the same kernels Python calls).
struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>
      add_rms_norm;
  c10::TypedOperatorHandle<void(Tensor, const Tensor&, const Tensor&)> rope;
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul;
  c10::TypedOperatorHandle<void(Tensor, Tensor, const Tensor&, const Tensor&, const Tensor&)> store_kv;
  c10::TypedOperatorHandle<void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, double)>
      attention;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, std::string_view,
                                  c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>
      packed_linear;

  static const Ops& get() {
    static const Ops ops = [] {
      auto& d = c10::Dispatcher::singleton();
      auto find = [&](const char* name) { return d.findSchemaOrThrow(name, ""); };
      return Ops{
          find("mmserve_cpu::rms_norm").typed<Tensor(const Tensor&, const Tensor&, double)>(),
          find("mmserve_cpu::add_rms_norm")
              .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(),
          find("mmserve_cpu::rope_").typed<void(Tensor, const Tensor&, const Tensor&)>(),
          find("mmserve_cpu::silu_mul").typed<Tensor(const Tensor&)>(),
          find("mmserve_cpu::store_kv_").typed<void(Tensor, Tensor, const Tensor&, const Tensor&, const Tensor&)>(),
          find("mmserve_cpu::decode_attention_")
              .typed<void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, double)>(),
          find("mkldnn::_linear_pointwise")
              .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, std::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>(),
      };
    }();
    return ops;
  }
};

Tensor linear(const Ops& ops, bool packed, const Tensor& x, const Tensor& weight,
              const std::optional<Tensor>& bias) {
  if (!packed) return at::linear(x, weight, bias);
  return ops.packed_linear.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// One layer over the residual stream x (T, hidden), given the previous layer's MLP output `delta` still to be
// added (none for the first layer): returns (the stream after the attention's residual add, this layer's MLP
// output). Adding delta inside the input norm (add_rms_norm) is the eager add and norm bit for bit, one pass.
// weights: input norm, q/k/v, o, post-attention norm, gate/up, down; biases: q/k/v, o, gate/up, down.
std::tuple<Tensor, Tensor> layer(const Ops& ops, const Tensor& x, const std::optional<Tensor>& delta,
                                 const Tensor* w, const std::optional<Tensor>* b, double input_eps, double post_eps,
                                 int64_t heads, int64_t kv_heads, bool packed, const Tensor& cos, const Tensor& sin,
                                 Tensor k_cache, Tensor v_cache, const Tensor& new_slots, const Tensor& rows,
                                 const Tensor& slots, const Tensor& lengths, double scale) {
  const int64_t t = x.size(0), dim = k_cache.size(2), qk_width = (heads + kv_heads) * dim;
  Tensor stream = x, normed;
  if (delta.has_value()) {
    std::tie(stream, normed) = ops.add_rms_norm.call(x, *delta, w[0], input_eps);
  } else {
    normed = ops.rms_norm.call(x, w[0], input_eps);
  }
  const Tensor qkv = linear(ops, packed, normed, w[1], b[0]);
  const Tensor qk = qkv.narrow(1, 0, qk_width).view({t, heads + kv_heads, dim});
  ops.rope.call(qk, cos, sin);  // in place: qkv is this layer's own
  const Tensor value = qkv.narrow(1, qk_width, kv_heads * dim).view({t, kv_heads, dim});
  ops.store_kv.call(k_cache, v_cache, new_slots, qk.narrow(1, heads, kv_heads), value);
  Tensor attended = at::empty({t, heads, dim}, x.options());
  ops.attention.call(attended, qk.narrow(1, 0, heads), rows, k_cache, v_cache, slots, lengths, scale);
  const Tensor attn = linear(ops, packed, attended.view({t, heads * dim}), w[2], b[1]);
  auto [h, post_normed] = ops.add_rms_norm.call(stream, attn, w[3], post_eps);
  const Tensor act = ops.silu_mul.call(linear(ops, packed, post_normed, w[4], b[2]));
  return {h, linear(ops, packed, act, w[5], b[3])};
}

// Every fused layer of a pure decode step: x (T, hidden) -> the last layer's output (T, hidden), before the
// model's final norm. T one-row queries; query row rows[i] attends over slots[i, :lengths[i]].
// weights: 6 per layer and biases: 4 per layer (`layer`), eps: 2 per layer; caches: one K and one V per layer.
Tensor decode_layers(const Tensor& x, at::TensorList weights, const c10::List<std::optional<Tensor>>& biases,
                     at::ArrayRef<double> eps, int64_t heads, int64_t kv_heads, bool packed, const Tensor& cos,
                     const Tensor& sin, at::TensorList k_caches, at::TensorList v_caches, const Tensor& new_slots,
                     const Tensor& rows, const Tensor& slots, const Tensor& lengths, double scale) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(layers > 0 && v_caches.size() == layers && weights.size() == 6 * layers &&
                  biases.size() == 4 * layers && eps.size() == 2 * layers,
              "decode_layers: per layer 6 weights, 4 biases, 2 eps, one K and one V cache");
  TORCH_CHECK(x.dim() == 2 && heads > 0 && kv_heads > 0, "decode_layers: x (T, hidden)");
  const Ops& ops = Ops::get();
  const std::vector<std::optional<Tensor>> bias_vec(biases.begin(), biases.end());
  Tensor stream = x;
  std::optional<Tensor> delta;
  for (size_t l = 0; l < layers; ++l) {
    std::tie(stream, delta) = layer(ops, stream, delta, weights.data() + 6 * l, bias_vec.data() + 4 * l,
                                    eps[2 * l], eps[2 * l + 1], heads, kv_heads, packed, cos, sin, k_caches[l],
                                    v_caches[l], new_slots, rows, slots, lengths, scale);
  }
  return stream + *delta;  // the last layer's residual add: the eager add
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mmserve_cpu, m) {
  m.def(
      "decode_layers(Tensor x, Tensor[] weights, Tensor?[] biases, float[] eps, int heads, int kv_heads, "
      "bool packed, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor new_slots, "
      "Tensor rows, Tensor slots, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
// oneDNN's packed weights are MKLDNN tensors, which put the call under that dispatch key.
TORCH_LIBRARY_IMPL(mmserve_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
