/* Binding the compute threads to CPUs, as vLLM's CPU worker does.
 *
 * torch's intra-op threads are an OpenMP team (the process has one OpenMP runtime: the
 * kernels here link the libgomp torch loaded). A team of n threads started by the same
 * calling thread reuses the same worker threads in the same order, so binding thread
 * number i of one n-thread region binds it for every later region of that thread. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>

/* Bind thread i of an n-thread team of the calling thread to cpus[i]; returns how many
 * threads could not be bound (0 on success). */
int64_t bind_omp_threads(const int64_t *cpus, int64_t n) {
    int64_t failed = 0;
#pragma omp parallel num_threads((int)n) reduction(+ : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET((int)cpus[omp_get_thread_num()], &set);
        failed += omp_get_num_threads() != n || sched_setaffinity(0, sizeof(set), &set) != 0;
    }
    return failed;
}

/* Let every thread of an n-thread team of the calling thread run on any of the
 * ncpus CPUs in cpus (undoing bind_omp_threads); returns how many threads failed. */
int64_t release_omp_threads(const int64_t *cpus, int64_t ncpus, int64_t n) {
    int64_t failed = 0;
#pragma omp parallel num_threads((int)n) reduction(+ : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int64_t i = 0; i < ncpus; i++)
            CPU_SET((int)cpus[i], &set);
        failed += omp_get_num_threads() != n || sched_setaffinity(0, sizeof(set), &set) != 0;
    }
    return failed;
}
