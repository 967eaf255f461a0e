// One decoder layer of a decode step in one call.
//
// workers/models/decoder.py runs a layer as ~20 torch ops from Python (norms, the four
// projections, the q/k/v views, RoPE, the K/V writes and the paged attention), each
// costing a few microseconds of Python and dispatch on top of its kernel: on a 2-core
// Zen 4 a 30-layer model with near-empty kernels still took ~5 ms per decode step. This op
// makes the same op calls, with the same arguments in the same order, from C++: the ops
// below are this library's own kernels (fused_ops.cpp, int8_linear.cpp,
// paged_attention.cpp) reached through the dispatcher, oneDNN's reordered-weight GEMM
// (mkldnn::_linear_pointwise, as workers.models.linear.onednn_linear calls it) and
// at::linear (F.linear), so its result is the Python layer's bit for bit.
//
// Scope (the caller checks it, workers/models/decoder.py NativeLayer): a step whose every
// token decodes (one per sequence, no prefill), an unquantized cache, float32 or bfloat16,
// projections run by one of the kinds below (float or int8 weights). Anything else takes
// the Python path.
//
// Registered as torch.ops.pdserve_kernels.decode_layer(x, mlp_out, input_norm, post_norm,
// q_norm, k_norm, eps, weights, kinds, qkv_bias, o_bias, cos, sin, num_heads,
// num_kv_heads, cache, block_size, slot_mapping, block_tables, context_lens, sum_lanes,
// silu_lanes, scales, int8_gemv_rows) -> the layer's MLP output. x, the residual stream
// [tokens, hidden], is updated in place: x += mlp_out (the previous layer's MLP output;
// None for the first layer) then x += the attention's projection, as the Python layer's
// two add_rms_norm do.
// weights: qkv, o, gate_up, down, each as ``kinds`` says: > 0 the GEMV's tiles
// (f32_gemv_packed, that many output rows), 0 the GEMV on a row-major weight (f32_gemv),
// -1 oneDNN on its reordered weight, -2 at::linear on the plain weight, -3 int8_linear on
// int8 values (row-major or tiles) with that projection's ``scales`` entry and
// ``int8_gemv_rows``, as workers.models.linear.int8_linear calls it.
// cache: the layer's [2, slots, kv_heads, head_dim] (K then V), written at slot_mapping.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "pds_onednn.h"

#include <cmath>
#include <optional>
#include <string>

namespace {

using OptTensor = std::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> typed(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

enum Kind : int64_t { kGemv = 0, kOneDnn = -1, kTorch = -2, kInt8 = -3 };  // > 0: GEMV tiles

// The ops a layer calls, looked up once (the library's own are registered by the time
// the first layer runs; oneDNN's only where torch has it).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t)>
      rms_norm = typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t)>(
          "pdserve_kernels::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double, int64_t)>
      add_rms_norm = typed<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double, int64_t)>("pdserve_kernels::add_rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&)> rope =
      typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>("pdserve_kernels::rope_");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t)> silu_mul =
      typed<at::Tensor(const at::Tensor&, int64_t)>("pdserve_kernels::silu_mul");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      int64_t)>
      gemv = typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)>(
          "pdserve_kernels::f32_gemv");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                      const OptTensor&, int64_t)>
      gemv_tiles = typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                    const OptTensor&, int64_t)>(
          "pdserve_kernels::f32_gemv_packed");
  using Int8 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const OptTensor&, int64_t, int64_t);
  c10::TypedOperatorHandle<Int8> int8 = typed<Int8>("pdserve_kernels::int8_linear");
  using Attend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double, int64_t);
  c10::TypedOperatorHandle<Attend> write_attend =
      typed<Attend>("pdserve_kernels::paged_write_decode_attention");
  const std::optional<c10::OperatorHandle>& onednn = pds::onednn_linear_op();
};

const Ops& ops() {
  static const Ops o;
  return o;
}

// One projection. int8: ``scale`` (its per-row scales) and ``int8_rows`` (the GEMV's
// row limit) are as the Python layer passes them; unused otherwise.
at::Tensor linear(const Ops& o, const at::Tensor& x, const at::Tensor& w, int64_t kind,
                  const OptTensor& bias, const OptTensor& scale = std::nullopt,
                  int64_t int8_rows = 0) {
  if (kind > 0) return o.gemv_tiles.call(x, w, kind, bias, -1);
  if (kind == kInt8) {
    TORCH_CHECK(scale.has_value(), "decode_layer: an int8 projection needs its scales");
    return o.int8.call(x, w, *scale, bias, int8_rows, -1);
  }
  if (kind == kGemv) return o.gemv.call(x, w, bias, -1);
  if (kind == kTorch) return at::linear(x, w, bias);
  TORCH_CHECK(kind == kOneDnn, "decode_layer: unknown projection kind ", kind);
  TORCH_CHECK(o.onednn.has_value(), "decode_layer: this torch has no oneDNN linear");
  return pds::onednn_linear(*o.onednn, x, w, bias);
}

at::Tensor decode_layer(at::Tensor& x, const OptTensor& mlp_out, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, const OptTensor& q_norm,
                        const OptTensor& k_norm, double eps, at::TensorList weights,
                        at::IntArrayRef kinds, const OptTensor& qkv_bias,
                        const OptTensor& o_bias, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t num_heads, int64_t num_kv_heads, const at::Tensor& cache,
                        int64_t block_size, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        int64_t sum_lanes, int64_t silu_lanes,
                        const c10::List<std::optional<at::Tensor>>& scales,
                        int64_t int8_gemv_rows) {
  TORCH_CHECK(weights.size() == 4 && kinds.size() == 4 && scales.size() == 4,
              "decode_layer: weights, kinds and scales are qkv, o, gate_up, down");
  const OptTensor s_qkv = scales.get(0), s_o = scales.get(1), s_gate_up = scales.get(2),
                  s_down = scales.get(3);
  TORCH_CHECK(x.dim() == 2, "decode_layer: x must be [tokens, hidden]");
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2,
              "decode_layer: cache must be [2, slots, kv_heads, head_dim]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(),
              "decode_layer: q_norm and k_norm come together");
  const Ops& o = ops();
  const int64_t n = x.size(0), dim = cache.size(3);
  const int64_t q_size = num_heads * dim, kv_size = num_kv_heads * dim;
  at::Tensor h = mlp_out.has_value() ? o.add_rms_norm.call(x, *mlp_out, input_norm, eps, sum_lanes)
                                     : o.rms_norm.call(x, input_norm, eps, sum_lanes);
  const at::Tensor qkv = linear(o, h, weights[0], kinds[0], qkv_bias, s_qkv, int8_gemv_rows);
  // Queries and keys are adjacent in the fused projection: rotated together.
  at::Tensor qk = qkv.slice(1, 0, q_size + kv_size).view({n, num_heads + num_kv_heads, dim});
  const at::Tensor v = qkv.slice(1, q_size + kv_size).view({n, num_kv_heads, dim});
  if (q_norm.has_value()) {
    at::Tensor q = qk.slice(1, 0, num_heads), k = qk.slice(1, num_heads);
    q.copy_(o.rms_norm.call(q, *q_norm, eps, sum_lanes));
    k.copy_(o.rms_norm.call(k, *k_norm, eps, sum_lanes));
  }
  o.rope.call(qk, cos, sin);
  const auto qk_parts = qk.split({num_heads, num_kv_heads}, 1);
  const at::Tensor k_blocks = cache.select(0, 0).view({-1, block_size, num_kv_heads, dim});
  const at::Tensor v_blocks = cache.select(0, 1).view({-1, block_size, num_kv_heads, dim});
  const at::Tensor attn = o.write_attend.call(qk_parts[0], qk_parts[1], v, k_blocks, v_blocks,
                                              slot_mapping, block_tables, context_lens,
                                              std::pow(static_cast<double>(dim), -0.5), -1);
  const at::Tensor proj =
      linear(o, attn.view({n, q_size}), weights[1], kinds[1], o_bias, s_o, int8_gemv_rows);
  h = o.add_rms_norm.call(x, proj, post_norm, eps, sum_lanes);
  const at::Tensor gate_up =
      linear(o, h, weights[2], kinds[2], std::nullopt, s_gate_up, int8_gemv_rows);
  return linear(o, o.silu_mul.call(gate_up, silu_lanes), weights[3], kinds[3], std::nullopt,
                s_down, int8_gemv_rows);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_kernels, m) {
  m.def(
      "decode_layer(Tensor(a!) x, Tensor? mlp_out, Tensor input_norm, Tensor post_norm, "
      "Tensor? q_norm, Tensor? k_norm, float eps, Tensor[] weights, int[] kinds, "
      "Tensor? qkv_bias, Tensor? o_bias, Tensor cos, Tensor sin, int num_heads, "
      "int num_kv_heads, Tensor(b!) cache, int block_size, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, int sum_lanes, int silu_lanes, "
      "Tensor?[] scales, int int8_gemv_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) { m.impl("decode_layer", &decode_layer); }
// oneDNN's reordered weights are MkldnnCPU tensors: a call holding one dispatches there.
TORCH_LIBRARY_IMPL(pdserve_kernels, MkldnnCPU, m) { m.impl("decode_layer", &decode_layer); }
