// One fused decoder layer of a pure decode step, in one call (`fused_layers.FusedDecoderLayer`).
//
// With the kernels of cpu_ops.cpp and decode_attention.cpp, a decode step's layer in Python was still about 25
// op calls, each with its Python and dispatcher overhead, and a module call per linear layer. At one row that
// was 4-5 ms of a 51 ms step, at 16 rows about 5 ms of 58. This op runs the same ops in the same order from
// C++: the input RMSNorm, the q/k/v GEMM, RoPE over q and k, the pool write, the decode attention, the output
// GEMM, the residual add with the post-attention RMSNorm, the gate/up GEMM, SiLU-and-mul, the down GEMM and
// the residual add. The GEMMs are oneDNN's packed ones (`mkldnn::_linear_pointwise`, as PackedLinear calls
// them) or `at::linear` for weights left unpacked, so the result is bitwise the Python layer's.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <tuple>

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

// x (T, hidden) -> the layer's output (T, hidden); T one-row queries, query row t attends over its own slots.
// weights: input norm, q/k/v, o, post-attention norm, gate/up, down; biases: q/k/v, o, gate/up, down.
Tensor decode_layer(const Tensor& x, at::TensorList weights, const c10::List<std::optional<Tensor>>& biases,
                    double input_eps, double post_eps, int64_t heads, int64_t kv_heads, bool packed,
                    const Tensor& cos, const Tensor& sin, Tensor k_cache, Tensor v_cache, const Tensor& new_slots,
                    const Tensor& rows, const Tensor& slots, const Tensor& lengths, double scale) {
  TORCH_CHECK(weights.size() == 6 && biases.size() == 4, "decode_layer: 6 weights and 4 biases");
  TORCH_CHECK(x.dim() == 2 && heads > 0 && kv_heads > 0, "decode_layer: x (T, hidden)");
  const Ops& ops = Ops::get();
  const int64_t t = x.size(0), dim = k_cache.size(2), qk_width = (heads + kv_heads) * dim;
  const Tensor qkv = linear(ops, packed, ops.rms_norm.call(x, weights[0], input_eps), weights[1], biases.get(0));
  const Tensor qk = qkv.narrow(1, 0, qk_width).view({t, heads + kv_heads, dim});
  ops.rope.call(qk, cos, sin);  // in place: qkv is this layer's own
  const Tensor value = qkv.narrow(1, qk_width, kv_heads * dim).view({t, kv_heads, dim});
  ops.store_kv.call(k_cache, v_cache, new_slots, qk.narrow(1, heads, kv_heads), value);
  Tensor attended = at::empty({t, heads, dim}, x.options());
  ops.attention.call(attended, qk.narrow(1, 0, heads), rows, k_cache, v_cache, slots, lengths, scale);
  const Tensor attn = linear(ops, packed, attended.view({t, heads * dim}), weights[2], biases.get(1));
  auto [h, normed] = ops.add_rms_norm.call(x, attn, weights[3], post_eps);
  const Tensor act = ops.silu_mul.call(linear(ops, packed, normed, weights[4], biases.get(2)));
  return h + linear(ops, packed, act, weights[5], biases.get(3));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mmserve_cpu, m) {
  m.def(
      "decode_layer(Tensor x, Tensor[] weights, Tensor?[] biases, float input_eps, float post_eps, int heads, "
      "int kv_heads, bool packed, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor new_slots, Tensor rows, Tensor slots, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) { m.impl("decode_layer", &decode_layer); }
// oneDNN's packed weights are MKLDNN tensors, which put the call under that dispatch key.
TORCH_LIBRARY_IMPL(mmserve_cpu, MkldnnCPU, m) { m.impl("decode_layer", &decode_layer); }
