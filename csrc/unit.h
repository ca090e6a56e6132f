// FetchUnit: the parameters gathered together (a module's direct and external parameters, or a
// GatheredParameters list), sorted by ds_id so that every rank issues the same collectives in the
// same order.
#pragma once
#include <algorithm>
#include <vector>
#include "handle.h"

namespace z3ext {

struct FetchUnit {
  std::vector<HandlePtr> handles;
  explicit FetchUnit(std::vector<HandlePtr> hs) : handles(std::move(hs)) {
    std::sort(handles.begin(), handles.end(),
              [](const HandlePtr& a, const HandlePtr& b) { return a->ds_id < b->ds_id; });
    handles.erase(std::unique(handles.begin(), handles.end()), handles.end());
  }
  int64_t partitioned() const {
    int64_t n = 0;
    for (const auto& h : handles) n += h->bucket ? 0 : 1;
    return n;
  }
  int64_t numel() const {
    int64_t n = 0;
    for (const auto& h : handles) n += h->numel;
    return n;
  }
};

}  // namespace z3ext
