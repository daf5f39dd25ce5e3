// Sleeping on a word: a private futex on Linux, short polling sleeps elsewhere.
#include "thread_wait.h"

#include <algorithm>
#include <climits>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace trainspec {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the futex word must be a plain 32-bit integer");

void SleepWhileEqual(std::atomic<uint32_t>* word, uint32_t expected,
                     std::chrono::nanoseconds max_wait) {
#if defined(__linux__)
  timespec ts;
  ts.tv_sec = static_cast<time_t>(max_wait.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(max_wait.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &ts,
          nullptr, 0);
#else
  // No futex: poll with short sleeps (correct, slower to wake).
  if (word->load(std::memory_order_acquire) == expected) {
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(
        max_wait, std::chrono::microseconds(50)));
  }
#endif
}

void WakeAll(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
#else
  (void)word;
#endif
}

}  // namespace trainspec
