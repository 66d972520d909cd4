// The engine's scheduling policy as one small class (as byteps's scheduled
// queue): items wait by priority, then in the order they came (`Order`
// decides); at most `credit` of them are out at a time (taken, not yet given
// back), so an item that arrives now waits behind at most `credit` items,
// not behind everything queued before it. Not thread-safe: the engine holds
// its lock around it.
#pragma once

#include <queue>
#include <vector>

namespace jbps {

template <typename T, typename Order>
class CreditQueue {
 public:
  void set_credit(int credit) { credit_ = credit; }
  int credit() const { return credit_; }
  void Push(T item) { queue_.push(std::move(item)); }
  // Whether an item waits and a credit is free for it.
  bool Ready() const { return !queue_.empty() && out_ < credit_; }
  // The first item in order; it takes no credit until Take().
  T Pop() {
    T item = queue_.top();
    queue_.pop();
    return item;
  }
  void Take() { ++out_; }
  void GiveBack(int n = 1) { out_ -= n; }
  int out() const { return out_; }
  size_t waiting() const { return queue_.size(); }
  void Clear() {
    queue_ = {};
    out_ = 0;
  }

 private:
  std::priority_queue<T, std::vector<T>, Order> queue_;
  int credit_ = 1;
  int out_ = 0;
};

}  // namespace jbps
