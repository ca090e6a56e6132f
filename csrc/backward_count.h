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

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace z3ext {

inline std::optional<int64_t> count_used_in_backward(const std::vector<at::Tensor>& params) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  const auto* in_graph = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (exec_info == nullptr || in_graph == nullptr)
    throw std::runtime_error("count_used_parameters_in_backward must be called during backward execution");
  if (!exec_info->empty()) return std::nullopt;
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

}  // namespace z3ext
