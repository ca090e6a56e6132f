// ZeroLinear: DeepSpeed's `LinearFunctionForZeroStage3` (memory_efficient_linear, DeepSpeed's default) as a C++
// autograd node, for a z3ext weight in grad mode ([Note: grad-mode linear] in deepspeed_z3ext/linear.py).
// The same ATen calls in the same order as that Function's forward and backward (0.19.8), so the same bits;
// what is gone is the Python autograd Function around them: its `apply` (a Python classmethod that binds
// its arguments with `inspect.signature` up to torch 2.13), `setup_context`, and a backward in Python
// under a `torch.autocast` context, which takes the GIL for every linear node of a backward.
#pragma once
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/autograd.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

namespace z3ext {

namespace py = pybind11;

// Stock's backward, called (with the GIL) for a weight that is released when its node runs: DeepSpeed's
// Function gathers it first and releases it after (`weight_was_partitioned`), as this Python callable
// does (linear.released_backward). Set once at import.
inline py::object& linear_released_backward() {
  static py::object* fn = new py::object();  // never destroyed: no Python call at interpreter exit
  return *fn;
}

struct ZeroLinear : public torch::autograd::Function<ZeroLinear> {
  // The Function's forward ops (0.19.8), for the node and for a call under no_grad.
  static at::Tensor compute(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    if (input.dim() == 2 && bias.has_value()) return at::addmm(*bias, input, weight.t());  // "fused op is marginally faster"
    at::Tensor ret = input.matmul(weight.t());
    if (bias.has_value()) ret.add_(*bias);  // `output += bias`
    return ret;
  }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    at::Tensor ret = compute(input, weight, bias);
    ctx->save_for_backward({input, weight, bias.has_value() ? *bias : at::Tensor()});
    return ret;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& bias = saved[2];
    const at::Tensor& grad_output = grads[0];
    const bool needs_input = ctx->needs_input_grad(0), needs_weight = ctx->needs_input_grad(1);
    const bool needs_bias = bias.defined() && ctx->needs_input_grad(2);
    if (weight.numel() == 0) {  // released (the empty placeholder) or an empty layer: stock's code decides
      py::gil_scoped_acquire gil;
      py::tuple out = linear_released_backward()(grad_output, input, weight, bias.defined() ? py::cast(bias) : py::none(),
                                                 py::make_tuple(needs_input, needs_weight, needs_bias));
      torch::autograd::variable_list result;
      for (auto item : out) result.push_back(item.is_none() ? at::Tensor() : item.cast<at::Tensor>());
      result.resize(3);
      return result;
    }
    // Stock runs its backward under `torch.autocast(enabled=False)` when the forward did not use autocast, the
    // only case taken here (ZeroLinear::maybe_apply): no autocast dispatch for these ops.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    at::Tensor grad_input, grad_weight, grad_bias;
    const int64_t dim = grad_output.dim();
    if (needs_input) grad_input = grad_output.matmul(weight);
    if (needs_weight) {
      if (dim > 2) {
        grad_weight = grad_output.reshape({-1, grad_output.size(-1)}).t().matmul(input.reshape({-1, input.size(-1)}));
      } else if (dim == 1) {
        grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0);
      } else {
        grad_weight = grad_output.t().matmul(input);
      }
    }
    if (needs_bias) {
      if (dim > 2) {
        std::vector<int64_t> dims(dim - 1);
        for (int64_t i = 0; i < dim - 1; ++i) dims[i] = i;
        grad_bias = grad_output.sum(dims);
      } else if (dim == 1) {
        grad_bias = grad_output;
      } else {
        grad_bias = grad_output.sum(0);
      }
    }
    return {grad_input, grad_weight, grad_bias};
  }

  // The node, or an undefined tensor where stock's Function must run instead: autocast on for the inputs'
  // device (stock records it for its backward), or inputs a functorch transform or a Python dispatch mode wraps.
  static at::Tensor maybe_apply(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    constexpr c10::DispatchKeySet wrapped =
        c10::DispatchKeySet({c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched,
                             c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot});
    auto keys = input.key_set() | weight.key_set();
    if (bias.has_value()) keys = keys | bias->key_set();
    if (keys.has_any(wrapped) || at::autocast::is_autocast_enabled(input.device().type())) return at::Tensor();
    return apply(input, weight, bias);
  }
};

// [Note: linear in one call] in deepspeed_z3ext/linear.py: `F.linear` as one C++ call where the Python seams would
// take the shortcut or the node: plain tensors (Tensor or Parameter, no subclass), no torch function mode, and
// under no_grad a z3ext weight or one of no ZeRO engine (its forward's ops), in grad mode a z3ext weight that is a
// Parameter with a Tensor input (the node, where it does not decline). None: the Python path decides.
inline py::object linear_call(py::handle input, py::handle weight, py::handle bias) {
  static PyObject* const state_attr = PyUnicode_InternFromString("_z3ext_state");  // deepspeed_z3ext.state.STATE_ATTR
  static PyObject* const ds_id_attr = PyUnicode_InternFromString("ds_id");
  const bool has_bias = !bias.is_none();
  if (!THPVariable_CheckExact(input.ptr()) || !THPVariable_CheckExact(weight.ptr()) ||
      (has_bias && !THPVariable_CheckExact(bias.ptr())) || at::impl::torch_function_mode_enabled())
    return py::none();
  const bool z3ext_weight = PyObject_HasAttr(weight.ptr(), state_attr) == 1;
  const at::Tensor& x = THPVariable_Unpack(input.ptr());
  const at::Tensor& w = THPVariable_Unpack(weight.ptr());
  std::optional<at::Tensor> b;
  if (has_bias) b = THPVariable_Unpack(bias.ptr());
  at::Tensor out;
  if (!at::GradMode::is_enabled()) {
    if (!z3ext_weight && PyObject_HasAttr(weight.ptr(), ds_id_attr) == 1) return py::none();  // a stock engine's
    py::gil_scoped_release no_gil;  // as torch's own bindings of these ops
    out = ZeroLinear::compute(x, w, b);
  } else {
    if (!z3ext_weight || Py_TYPE(input.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
        Py_TYPE(weight.ptr()) != reinterpret_cast<PyTypeObject*>(ParameterClass))
      return py::none();
    out = ZeroLinear::maybe_apply(x, w, b);
    if (!out.defined()) return py::none();
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
}

}  // namespace z3ext
