/* The compute threads meeting between the phases of one parallel region, by spinning.
 *
 * A captured step (decode_step.c) is one OpenMP parallel region: its phases (a norm, a
 * linear layer, attention, ...) are the kernels' `_part` functions (step_parts.h), each
 * thread taking its share, and the threads meet here between phases. Run as separate
 * calls, each phase would open a region of its own, two hundred a step of a 16-layer
 * model. libgomp lets a region's idle threads spin only while the process holds no more
 * of its threads than CPUs; any other thread that has run a parallel torch op (the
 * caller's, before it built the engine) keeps a team of its own and tips the count, and
 * from then on every region start and end waits on a futex wake: a 1B model's decode
 * step took 40 % longer. This barrier spins whatever the count, and yields the CPU
 * after a while, so a thread that lost its core still lets the other one run. */
#ifndef KVSERVE_TEAM_H
#define KVSERVE_TEAM_H

#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TEAM_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define TEAM_PAUSE() __asm__ __volatile__("yield")
#else
#define TEAM_PAUSE() ((void)0)
#endif

#define TEAM_SPINS_BEFORE_YIELD 20000

typedef struct {
    _Atomic int64_t arrived; /* threads at the barrier in this round */
    _Atomic int64_t round;   /* rounds completed */
} team_barrier;

/* Wait until every thread of the calling region's team has called this for the same
 * round; what each wrote before is visible to all after. */
static inline void team_wait(team_barrier *b) {
    const int64_t threads = omp_get_num_threads();
    if (threads == 1) return;
    const int64_t round = atomic_load_explicit(&b->round, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == threads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->round, round + 1, memory_order_release);
        return;
    }
    for (int64_t spins = 0; atomic_load_explicit(&b->round, memory_order_acquire) == round;
         spins++) {
        if (spins < TEAM_SPINS_BEFORE_YIELD)
            TEAM_PAUSE();
        else
            sched_yield();
    }
}

#endif
