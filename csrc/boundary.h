// InputBoundary: the identity autograd node z3ext puts on each module input that needs grad, as
// stock DeepSpeed does (forward `detach()`, backward passes the gradient through). See
// [Note: input boundary] in hooks.py: it fixes the order in which autograd sums the gradient of a
// tensor read inside and outside a module. In C++: a Python autograd.Function costs several
// microseconds per module call in forward and takes the GIL for every node in backward.
#pragma once
#include <torch/autograd.h>

namespace z3ext {

struct InputBoundary : public torch::autograd::Function<InputBoundary> {
  static at::Tensor forward(torch::autograd::AutogradContext* /*ctx*/, const at::Tensor& x) { return x.detach(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list grads) {
    return grads;
  }
};

inline at::Tensor input_boundary(const at::Tensor& x) { return InputBoundary::apply(x); }

}  // namespace z3ext
