// Tensor memory on the CPU, kept for reuse. c10's default CPU allocator asks posix_memalign for 64-byte-aligned
// memory on every allocation, which glibc serves on its slow path (no per-thread cache); a decode step allocates
// and frees a few hundred small tensors. This allocator keeps freed blocks by size class and hands them out again:
//     allocate 3,000 B -> class 6 (64 << 6 = 4,096 B); a kept block of class 6 if there is one, else a new one
//     free it          -> back to class 6's list (at most kKept kept; more go back to the system)
// Blocks over kLargest bytes come from the system and go back to it. A block starts with a header of kHeader bytes
// that holds its class; the data after it stays 64-byte aligned.
#include <torch/library.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <pthread.h>
#include <mutex>
#include <new>
#include <vector>

namespace {

constexpr size_t kHeader = 64;
constexpr int kClasses = 15;                  // 64 B << 0 .. 14: up to kLargest
constexpr size_t kLargest = size_t(64) << (kClasses - 1);   // 1 MB
constexpr size_t kKept = 32;                  // kept blocks per class, at most

// Never destroyed: tensors may still be freed while the process exits, after this library's statics would be gone.
struct Kept {
  std::mutex mu;   // guards lists (engines free tensors on several threads)
  std::vector<void*> lists[kClasses];
};
Kept& kept = *new Kept;

int size_class(size_t bytes) {   // -1: larger than kLargest
  if (bytes > kLargest) return -1;
  int c = 0;
  while ((size_t(64) << c) < bytes) c++;
  return c;
}

void release(void* data) {
  void* block = static_cast<char*>(data) - kHeader;
  const int c = *static_cast<int*>(block);
  if (c >= 0) {
    std::lock_guard<std::mutex> lock(kept.mu);
    if (kept.lists[c].size() < kKept) {
      kept.lists[c].push_back(block);
      return;
    }
  }
  c10::free_cpu(block);
}

struct KeepingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    const int c = size_class(bytes);
    void* block = nullptr;
    if (c >= 0) {
      std::lock_guard<std::mutex> lock(kept.mu);
      if (!kept.lists[c].empty()) {
        block = kept.lists[c].back();
        kept.lists[c].pop_back();
      }
    }
    if (block == nullptr) block = c10::alloc_cpu(kHeader + (c >= 0 ? size_t(64) << c : bytes));
    *static_cast<int*>(block) = c;
    void* data = static_cast<char*>(block) + kHeader;
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

KeepingAllocator& allocator = *new KeepingAllocator;   // (never destroyed either)

// Makes it the CPU allocator of the process (tensors allocated before keep their own deleter). A forked child may
// have been forked while another thread held the lock: it starts with a fresh one.
void keep_freed_cpu_memory() {
  static const bool installed = [] {
    pthread_atfork(nullptr, nullptr, [] { new (&kept.mu) std::mutex(); });
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
    return true;
  }();
  (void)installed;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtpserve_cpu, m) {
  m.def("keep_freed_cpu_memory() -> ()", &keep_freed_cpu_memory);
}
