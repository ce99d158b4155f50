// Work that rides another op's parallel region: items any thread of the region may claim, each run once.
//
// At batch 1 a LoRA pass is a few microseconds of fetching its adapter's weights; in a region of its own
// every pass paid a fork and a join and waited on its first cold lines alone (a rank-1 adapter's 120 passes
// cost 0.33-0.42 ms of a 4.5 ms step, 2026-12-03). Riding the base matmul's region, the passes' fetches
// overlap the matmul's stream and cost no region of their own (csrc/decoder_stack.cpp).
#pragma once

#include <atomic>
#include <cstdint>

namespace tokenloom_side {

class SideWork {
 public:
  explicit SideWork(int64_t items) : items_(items) {}
  virtual ~SideWork() = default;

  // Claims and runs items until none is left; any number of threads may call it at once.
  void run() {
    for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < items_;
         i = next_.fetch_add(1, std::memory_order_relaxed))
      run_item(i);
  }

 protected:
  virtual void run_item(int64_t item) = 0;

 private:
  const int64_t items_;
  std::atomic<int64_t> next_{0};
};

}  // namespace tokenloom_side
