// InputBoundary: the identity autograd node z3ext puts on each module input that needs grad, as
// stock DeepSpeed does (forward `detach()`, backward passes the gradient through). See
// [Note: input boundary] in hooks.py: it fixes the order in which autograd sums the gradient of a
// tensor read inside and outside a module. In C++: a Python autograd.Function costs several
// microseconds per module call in forward and takes the GIL for every node in backward.
#pragma once
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <memory>
#include <type_traits>

namespace z3ext {

// A plain Node rather than a torch::autograd::Function: the Function's apply (its context, the checks of
// outputs against inputs, views and dirty tensors) and its CppNode's backward cost about as much as a small
// module's own ops. The node is the Function's to the bit: created at the same point (its sequence number
// orders the backward the same), its one gradient passed through, an undefined one materialized as zeros
// (a C++ Function's `materialize_grads`).
struct InputBoundaryBackward : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) grads[0] = input_metadata(0).zeros_like();
    return std::move(grads);
  }
  std::string name() const override { return "InputBoundaryBackward"; }
  // Compiled autograd: nothing saved, the identity traced as is.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {}
  torch::autograd::variable_list apply_with_saved(const torch::autograd::variable_list& inputs,
                                                  torch::dynamo::autograd::SwapSavedVariables& /*saved*/) override {
    return apply(torch::autograd::variable_list(inputs));
  }
};

// A new node of type N held as torch's autograd holds nodes: by `c10::intrusive_ptr` where `Node` is an
// intrusive_ptr_target (torch 2.13), else by `std::shared_ptr` with torch's iterative deleter (torch 2.11).
template <class N>
auto make_node() {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>) {
    return c10::make_intrusive<N>();
  } else {
    return std::shared_ptr<N>(new N(), [](N* node) { deleteNode(node); });  // torch::autograd's, by argument lookup
  }
}

inline at::Tensor input_boundary(const at::Tensor& x) {
  at::Tensor out = x.detach();
  if (!torch::autograd::GradMode::is_enabled() || !x.requires_grad()) return out;
  auto node = make_node<InputBoundaryBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace z3ext
