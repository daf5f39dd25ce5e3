// How a rendezvous member waits for a 32-bit word to change: pause in a spin, sleep on the word
// (a futex on Linux), wake every sleeper. Kept apart from the meeting logic (rendezvous.cc),
// which decides when to spin, yield or sleep.
#ifndef TRAINSPEC_XLA_EXT_THREAD_WAIT_H_
#define TRAINSPEC_XLA_EXT_THREAD_WAIT_H_

#include <atomic>
#include <chrono>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace trainspec {

// One spin iteration's pause: lets the sibling hyperthread run and saves power.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Sleeps while *word == expected, at most `max_wait`; spurious returns are fine (callers loop).
void SleepWhileEqual(std::atomic<uint32_t>* word, uint32_t expected,
                     std::chrono::nanoseconds max_wait);

// Wakes every thread sleeping on `word` (SleepWhileEqual).
void WakeAll(std::atomic<uint32_t>* word);

}  // namespace trainspec

#endif  // TRAINSPEC_XLA_EXT_THREAD_WAIT_H_
