// oneDNN's linear layer (mkldnn::_linear_pointwise, as workers.models.linear.onednn_linear
// calls it), reached through the dispatcher from the kernels that run a GEMM of their own
// (decode_layer.cpp's projections, int8_linear.cpp's dequantized GEMM path).
//
// Part of the kernel build's cache key (workers/engine/kernels/__init__.py HEADERS).

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>

namespace pds {

// The op, looked up once; nullopt where this torch has no oneDNN CPU backend.
inline const std::optional<c10::OperatorHandle>& onednn_linear_op() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""});
  return op;
}

// x @ w.T (+ bias): w reordered by mkldnn::_reorder_linear_weight, or a plain [N, K]
// (the primitive is then built on that layout as it is).
inline at::Tensor onednn_linear(const c10::OperatorHandle& op, const at::Tensor& x,
                                const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  // _linear_pointwise(X, W, B, attr, scalars, algorithm)
  torch::jit::Stack stack{x, w, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(stack);
  return stack.back().toTensor();
}

}  // namespace pds
