// [Note: backward hook count] DeepSpeed's stage-3 gradient hook runs its epilogue once every
// parameter the running backward will reach has delivered its gradient. At the first hook of each
// backward (and of each reentrant-checkpoint phase) it counts those parameters with
// `count_used_parameters_in_backward` (deepspeed/runtime/utils.py): per parameter a
// `torch.enable_grad()` block, a `view_as` that makes an autograd node only to read its
// AccumulateGrad, a set insertion, then `_will_engine_execute_node` per node: about 4 us per
// parameter on a VM core, 0.8 ms of a 16-layer GPT's backward. This is the same count in one call:
// - a leaf parameter's node is its AccumulateGrad. When the parameter has none (never used with
//   grad enabled since its last one was freed), no graph can contain it, and stock's freshly made
//   one is in none either: it counts for nothing in both;
// - a non-leaf one's node is its grad_fn; distinct nodes are counted once;
// - a node counts when it is in the current graph task. A backward restricted to some inputs
//   (`autograd.grad`, `backward(inputs=)`) also filters by what executes: there `count` returns
//   nothing and DeepSpeed's own function runs (and raises what it raises).
#pragma once
#include <optional>
#include <stdexcept>
#include <unordered_set>
#include <vector>

#include <cstring>
#include <string>
#include <typeinfo>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace z3ext {

// The running graph task's nodes; nullptr for a backward restricted to some inputs (its exec_info not empty),
// where the graph alone does not decide what executes.
inline const std::unordered_set<torch::autograd::Node*>* nodes_of_unrestricted_backward(const char* caller) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  const auto* in_graph = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (exec_info == nullptr || in_graph == nullptr)
    throw std::runtime_error(std::string(caller) + " must be called during backward execution");
  return exec_info->empty() ? in_graph : nullptr;
}

inline std::optional<int64_t> count_used_in_backward(const std::vector<at::Tensor>& params) {
  const auto* in_graph = nodes_of_unrestricted_backward("count_used_parameters_in_backward");
  if (in_graph == nullptr) return std::nullopt;
  std::unordered_set<const torch::autograd::Node*> seen;
  seen.reserve(params.size());
  int64_t used = 0;
  for (const auto& p : params) {
    if (!p.defined() || !p.requires_grad()) continue;
    const torch::autograd::Node* node = nullptr;
    if (p.grad_fn()) {
      node = p.grad_fn().get();
    } else {
      auto acc = torch::autograd::impl::try_get_grad_accumulator(p);
      node = acc.get();
    }
    if (node == nullptr || !seen.insert(node).second) continue;
    if (in_graph->count(const_cast<torch::autograd::Node*>(node))) ++used;
  }
  return used;
}

// [Note: gradients this backward will not deliver] (grads.py [Note: fixed gradient layout]) Which of `params`
// (each a leaf parameter) the running backward cannot reach: their indices, and whether the graph holds a
// node that may run a backward of its own (a reentrant checkpoint: `CheckpointFunction`, torch's or
// DeepSpeed's), whose parameters are in no graph until it runs. A parameter without an AccumulateGrad,
// or whose AccumulateGrad is not in the graph, gets no gradient in this graph task. nullopt for a backward
// restricted to some inputs (`exec_info` not empty), where the graph alone does not decide.
struct Unreached {
  std::vector<int64_t> indices;
  bool reentrant = false;
};

inline std::optional<Unreached> unreached_in_backward(const std::vector<at::Tensor>& params) {
  const auto* in_graph = nodes_of_unrestricted_backward("unreached_in_backward");
  if (in_graph == nullptr) return std::nullopt;
  Unreached out;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    auto acc = p.defined() ? torch::autograd::impl::try_get_grad_accumulator(p) : nullptr;
    if (acc == nullptr || !in_graph->count(acc.get())) out.indices.push_back(static_cast<int64_t>(i));
  }
  for (auto* node : *in_graph) {
    // A Python autograd Function's node (torch::autograd::PyNode, whose type information libtorch_python does
    // not export): its name, which costs a demangling on C++ nodes, is asked of those alone.
    if (std::strcmp(typeid(*node).name(), "N5torch8autograd6PyNodeE") != 0) continue;
    if (node->name().find("CheckpointFunction") != std::string::npos) {
      out.reentrant = true;
      break;
    }
  }
  return out;
}

}  // namespace z3ext
