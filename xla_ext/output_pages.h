// Preparing a collective's output buffer before anyone writes into it.
//
// XLA allocates outputs with malloc; a loop that keeps the previous result alive (a training
// step, the bench) often gets pages the allocator has just trimmed or mmapped, so first-touch
// page faults are a large part of every large collective (docs/xla_ext.md, "Fresh output
// pages"). Both measures here are hints: if the kernel lacks them, the pages fault in as usual.
#pragma once

#include <cstddef>

namespace trainspec {

// Outputs at least this large are fresh mmap()ed memory (glibc's mmap threshold is at most
// 32 MiB): their huge pages fault in on first touch instead of being prefaulted.
constexpr size_t kHugePageBytes = 32 << 20;

// Outputs of 1 MiB and more: asks for transparent huge pages over the output's 2 MiB-aligned
// range, and below kHugePageBytes maps its missing pages in one go. Call before any member
// writes to `out`.
void PrepareOutputPages(void* out, size_t bytes);

}  // namespace trainspec
