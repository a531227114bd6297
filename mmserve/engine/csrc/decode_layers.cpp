// Every fused decoder layer of a pure decode step, in one call (`fused_layers.DecodeStack`).
//
// With the kernels of cpu_ops.cpp and decode_attention.cpp, a decode step's layer in Python was still about 25
// op calls, each with its Python and dispatcher overhead, and a module call per linear layer: at one row 4-5 ms
// of a 51 ms step. This op runs the same ops in the same order from C++, layer after layer: the input RMSNorm
// (with the previous layer's residual add, as add_rms_norm does it: the eager add bit for bit), the q/k/v GEMM,
// RoPE over q and k, the pool write, the decode attention, the output GEMM, the residual add with the
// post-attention RMSNorm, the gate/up GEMM, SiLU-and-mul and the down GEMM. The GEMMs are oneDNN's packed ones
// (`mkldnn::_linear_pointwise`, as PackedLinear calls them) or `at::linear` for weights left unpacked, so the
// result is bitwise the Python layers'. `decode_layers_quant` runs the same layers over quantized weights
// (mmserve/quant), each linear layer through `quant_linear` as QuantLinear calls it. An 8-bit pool
// (`--kv-cache-dtype`) gets its rows rounded as the Python layers round them (mmserve.engine.cache.kv_dtype).
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
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t,
                                  int64_t, const std::optional<Tensor>&)>
      quant_linear;

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
          find("mmserve_cpu::quant_linear")
              .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t,
                            int64_t, const std::optional<Tensor>&)>(),
      };
    }();
    return ops;
  }
};

// One of a layer's four linear layers: a dense weight (oneDNN-packed or not), or quantized codes
// (mmserve/quant: codes, scales, zero points, kind and group, as QuantLinear calls quant_linear).
struct Linear {
  const Tensor* weight = nullptr;  // dense
  bool packed = false;
  const Tensor* codes = nullptr;  // quantized
  const Tensor* scales = nullptr;
  const std::optional<Tensor>* zeros = nullptr;
  int64_t kind = 0, group = 0;
};

Tensor linear(const Ops& ops, const Linear& lin, const Tensor& x, const std::optional<Tensor>& bias) {
  if (lin.codes != nullptr) return ops.quant_linear.call(x, *lin.codes, *lin.scales, *lin.zeros, lin.kind, lin.group, bias);
  if (!lin.packed) return at::linear(x, *lin.weight, bias);
  return ops.packed_linear.call(x, *lin.weight, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// One layer over the residual stream x (T, hidden), given the previous layer's MLP output `delta` still to be
// added (none for the first layer): returns (the stream after the attention's residual add, this layer's MLP
// output). Adding delta inside the input norm (add_rms_norm) is the eager add and norm bit for bit, one pass.
// norms: input, post-attention; lin: q/k/v, o, gate/up, down; biases: q/k/v, o, gate/up, down.
std::tuple<Tensor, Tensor> layer(const Ops& ops, const Tensor& x, const std::optional<Tensor>& delta,
                                 const Tensor* norms, const Linear* lin, const std::optional<Tensor>* b,
                                 double input_eps, double post_eps, int64_t heads, int64_t kv_heads,
                                 const Tensor& cos, const Tensor& sin,
                                 Tensor k_cache, Tensor v_cache, const Tensor& new_slots, const Tensor& rows,
                                 const Tensor& slots, const Tensor& lengths, double scale) {
  const bool int8 = k_cache.scalar_type() == at::kChar;  // rows of codes, then their scale's 4 bytes
  const int64_t t = x.size(0), dim = k_cache.size(2) - (int8 ? kInt8ScaleBytes : 0), qk_width = (heads + kv_heads) * dim;
  Tensor stream = x, normed;
  if (delta.has_value()) {
    std::tie(stream, normed) = ops.add_rms_norm.call(x, *delta, norms[0], input_eps);
  } else {
    normed = ops.rms_norm.call(x, norms[0], input_eps);
  }
  const Tensor qkv = linear(ops, lin[0], normed, b[0]);
  const Tensor qk = qkv.narrow(1, 0, qk_width).view({t, heads + kv_heads, dim});
  ops.rope.call(qk, cos, sin);  // in place: qkv is this layer's own
  const Tensor value = qkv.narrow(1, qk_width, kv_heads * dim).view({t, kv_heads, dim});
  const Tensor key = qk.narrow(1, heads, kv_heads);
  if (k_cache.scalar_type() == x.scalar_type() || int8) {  // an int8 pool: store_kv_ quantizes the rows
    ops.store_kv.call(k_cache, v_cache, new_slots, key, value);
  } else {  // an fp8 pool: the rows rounded as kv_dtype.to_cache does it (saturated, then cast)
    const double top = k_cache.scalar_type() == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
    auto to_cache = [&](const Tensor& t) { return at::clamp(t, -top, top).to(k_cache.scalar_type()); };
    ops.store_kv.call(k_cache, v_cache, new_slots, to_cache(key), to_cache(value));
  }
  Tensor attended = at::empty({t, heads, dim}, x.options());
  ops.attention.call(attended, qk.narrow(1, 0, heads), rows, k_cache, v_cache, slots, lengths, scale);
  const Tensor attn = linear(ops, lin[1], attended.view({t, heads * dim}), b[1]);
  auto [h, post_normed] = ops.add_rms_norm.call(stream, attn, norms[1], post_eps);
  const Tensor act = ops.silu_mul.call(linear(ops, lin[2], post_normed, b[2]));
  return {h, linear(ops, lin[3], act, b[3])};
}

// Every layer in turn (the two ops below differ only in how their linear layers are given).
Tensor run_layers(const Ops& ops, const Tensor& x, const std::vector<Tensor>& norms, const std::vector<Linear>& lin,
                  const std::vector<std::optional<Tensor>>& biases, at::ArrayRef<double> eps, int64_t heads,
                  int64_t kv_heads, const Tensor& cos, const Tensor& sin, at::TensorList k_caches,
                  at::TensorList v_caches, const Tensor& new_slots, const Tensor& rows, const Tensor& slots,
                  const Tensor& lengths, double scale) {
  Tensor stream = x;
  std::optional<Tensor> delta;
  for (size_t l = 0; l < k_caches.size(); ++l) {
    std::tie(stream, delta) = layer(ops, stream, delta, norms.data() + 2 * l, lin.data() + 4 * l,
                                    biases.data() + 4 * l, eps[2 * l], eps[2 * l + 1], heads, kv_heads, cos, sin,
                                    k_caches[l], v_caches[l], new_slots, rows, slots, lengths, scale);
  }
  return stream + *delta;  // the last layer's residual add: the eager add
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
  const std::vector<std::optional<Tensor>> bias_vec(biases.begin(), biases.end());
  std::vector<Tensor> norms;
  std::vector<Linear> lin;
  for (size_t l = 0; l < layers; ++l) {
    const Tensor* w = weights.data() + 6 * l;
    norms.insert(norms.end(), {w[0], w[3]});
    for (int i : {1, 2, 4, 5}) lin.push_back(Linear{&w[i], packed});
  }
  return run_layers(Ops::get(), x, norms, lin, bias_vec, eps, heads, kv_heads, cos, sin, k_caches, v_caches,
                    new_slots, rows, slots, lengths, scale);
}

// decode_layers with quantized linear layers (mmserve/quant), 4 per layer in the order q/k/v, o, gate/up, down:
// their codes, scales, zero points, kinds and groups; norms: 2 per layer (input, post-attention).
Tensor decode_layers_quant(const Tensor& x, at::TensorList norms, at::TensorList codes, at::TensorList scales,
                           const c10::List<std::optional<Tensor>>& zeros, at::IntArrayRef kinds,
                           at::IntArrayRef groups, const c10::List<std::optional<Tensor>>& biases,
                           at::ArrayRef<double> eps, int64_t heads, int64_t kv_heads, const Tensor& cos,
                           const Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                           const Tensor& new_slots, const Tensor& rows, const Tensor& slots, const Tensor& lengths,
                           double scale) {
  const size_t layers = k_caches.size(), n = 4 * layers;
  TORCH_CHECK(layers > 0 && v_caches.size() == layers && norms.size() == 2 * layers && codes.size() == n &&
                  scales.size() == n && zeros.size() == n && kinds.size() == n && groups.size() == n &&
                  biases.size() == n && eps.size() == 2 * layers,
              "decode_layers_quant: per layer 2 norms, 4 quantized linears and biases, 2 eps, one K and one V cache");
  TORCH_CHECK(x.dim() == 2 && heads > 0 && kv_heads > 0, "decode_layers_quant: x (T, hidden)");
  const std::vector<std::optional<Tensor>> bias_vec(biases.begin(), biases.end());
  const std::vector<std::optional<Tensor>> zero_vec(zeros.begin(), zeros.end());
  std::vector<Linear> lin(n);
  for (size_t i = 0; i < n; ++i)
    lin[i] = Linear{nullptr, false, &codes[i], &scales[i], &zero_vec[i], kinds[i], groups[i]};
  return run_layers(Ops::get(), x, norms.vec(), lin, bias_vec, eps, heads, kv_heads, cos, sin, k_caches, v_caches,
                    new_slots, rows, slots, lengths, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mmserve_cpu, m) {
  m.def(
      "decode_layers(Tensor x, Tensor[] weights, Tensor?[] biases, float[] eps, int heads, int kv_heads, "
      "bool packed, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor new_slots, "
      "Tensor rows, Tensor slots, Tensor lengths, float scale) -> Tensor");
  m.def(
      "decode_layers_quant(Tensor x, Tensor[] norms, Tensor[] codes, Tensor[] scales, Tensor?[] zeros, int[] kinds, "
      "int[] groups, Tensor?[] biases, float[] eps, int heads, int kv_heads, Tensor cos, Tensor sin, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor new_slots, Tensor rows, Tensor slots, Tensor lengths, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_layers_quant", &decode_layers_quant);
}
// oneDNN's packed weights are MKLDNN tensors, which put the call under that dispatch key.
TORCH_LIBRARY_IMPL(mmserve_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
