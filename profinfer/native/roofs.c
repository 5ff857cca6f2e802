/* Roofs of this machine for profinfer's roofline: read bandwidth, triad bandwidth and f32 FMA
 * throughput, each with N threads (OpenMP), best of several repetitions.
 * Prints one JSON object. Built and run by profinfer/calibrate.py.
 *
 *   roofs THREADS MIB_PER_ARRAY
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef float v8 __attribute__((vector_size(32)));

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define REPS 5
#define ACC 12

int main(int argc, char **argv)
{
    int threads = argc > 1 ? atoi(argv[1]) : omp_get_max_threads();
    size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 256;
    size_t n = mib * (1u << 20) / sizeof(float);
    omp_set_num_threads(threads);
    float *a = aligned_alloc(64, n * sizeof(float));
    float *b = aligned_alloc(64, n * sizeof(float));
    float *c = aligned_alloc(64, n * sizeof(float));
    if (!a || !b || !c)
        return 1;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {   /* first touch by the thread that will use the page */
        a[i] = 1.0f;
        b[i] = 2.0f;
        c[i] = 0.5f;
    }

    double best_read = 1e30, best_triad = 1e30, best_fma = 1e30;
    float sink = 0;
    for (int rep = 0; rep < REPS; rep++) {
        double t0 = now();
        float s = 0;
#pragma omp parallel for schedule(static) reduction(+:s)
        for (size_t i = 0; i < n; i++)
            s += a[i];
        double t1 = now();
        sink += s;
        if (t1 - t0 < best_read)
            best_read = t1 - t0;

        t0 = now();
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++)
            a[i] = b[i] + 3.0f * c[i];
        t1 = now();
        if (t1 - t0 < best_triad)
            best_triad = t1 - t0;
    }

    const long iters = 20 * 1000 * 1000;
    for (int rep = 0; rep < REPS; rep++) {
        double t0 = now();
#pragma omp parallel reduction(+:sink)
        {
            v8 acc[ACC];
            v8 x = {0.9999999f, 0.9999998f, 0.9999997f, 0.9999996f,
                    0.9999995f, 0.9999994f, 0.9999993f, 0.9999992f};
            v8 y = x * 1e-7f;
            for (int k = 0; k < ACC; k++)
                acc[k] = x * (float)(k + omp_get_thread_num());
            for (long it = 0; it < iters; it++) {
#pragma GCC unroll 12
                for (int k = 0; k < ACC; k++)
                    acc[k] = acc[k] * x + y;
            }
            float s = 0;
            for (int k = 0; k < ACC; k++)
                for (int j = 0; j < 8; j++)
                    s += acc[k][j];
            sink += s;
        }
        double t1 = now();
        if (t1 - t0 < best_fma)
            best_fma = t1 - t0;
    }
    double fma_flops = (double)iters * ACC * 8 * 2 * threads;
    printf("{\"threads\": %d, \"read_gbps\": %.3f, \"triad_gbps\": %.3f, \"fma_gflops\": %.3f, "
           "\"sink\": %g}\n", threads, n * sizeof(float) / best_read / 1e9,
           3.0 * n * sizeof(float) / best_triad / 1e9, fma_flops / best_fma / 1e9, (double)sink);
    return 0;
}
