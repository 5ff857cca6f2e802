/* Roofs of this machine for profinfer's roofline: read bandwidth, triad bandwidth and f32 FMA
 * throughput, each with N threads (OpenMP), over several repetitions.
 * Prints one JSON object with every repetition's result and the share of the repetition's
 * wall time x N that this process spent on a CPU (under 1 when something else took our
 * CPUs). profinfer/core/calibration/machine_roofs.py builds and runs it, and judges stability and load from that.
 *
 * Each LEVEL:BYTES argument adds a cache level's read bandwidth: every thread reads its own
 * BYTES-long buffer (sized by the caller to fit its share of that level) over and over, so
 * the reads hit that level, not DRAM. Printed as LEVEL_gbps and LEVEL_cpu_share.
 *
 *   roofs THREADS MIB_PER_ARRAY [LEVEL:BYTES ...]
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
/* The cache reader's sums are one register each ("+v" below keeps them there): 64 bytes
 * with AVX-512, 32 without (AVX2, NEON pairs), where a v16 would need two and spill. */
#ifdef __AVX512F__
typedef v16 vreg;
#else
typedef v8 vreg;
#endif
#define LANES (sizeof(vreg) / sizeof(float))

static double seconds(clockid_t clock)
{
    struct timespec t;
    clock_gettime(clock, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define REPS 7
#define ACC 12
#define MAX_LEVELS 4
#define READ_ACC 8                  /* independent sums: the loop waits on loads, not on adds */
#define CACHE_BYTES_READ (1ul << 31) /* per thread and repetition: tens of ms at cache speed */

struct rep {
    double wall0, cpu0;
};

static struct rep rep_start(void)
{
    struct rep r = {seconds(CLOCK_MONOTONIC), seconds(CLOCK_PROCESS_CPUTIME_ID)};
    return r;
}

/* wall seconds since `r`; *share: CPU time of all our threads over wall x threads */
static double rep_end(struct rep r, int threads, double *share)
{
    double wall = seconds(CLOCK_MONOTONIC) - r.wall0;
    *share = (seconds(CLOCK_PROCESS_CPUTIME_ID) - r.cpu0) / (wall * threads);
    return wall;
}

static void print_series(const char *name, const double *v)
{
    printf("\"%s\": [", name);
    for (int i = 0; i < REPS; i++)
        printf("%s%.4f", i ? ", " : "", v[i]);
    printf("], ");
}

/* Read bandwidth of a working set of `bytes` per thread (a multiple of READ_ACC x 64),
 * held by each thread's own cache: REPS repetitions into gbps[], share[]. */
static float cache_read(int threads, size_t bytes, double *gbps, double *share)
{
    const size_t n = bytes / sizeof(v16);
    const long passes = (long)(CACHE_BYTES_READ / bytes) + 1;
    float sink = 0;
    v16 **bufs = calloc(threads, sizeof(*bufs));
#pragma omp parallel
    {   /* allocated and filled by its reader: in its cache, on its NUMA node */
        v16 *buf = aligned_alloc(64, n * sizeof(v16));
        for (size_t i = 0; i < n; i++)
            buf[i] = (v16){0} + 1.0f / (float)(i + 1);
        bufs[omp_get_thread_num()] = buf;
    }
    for (int rep = 0; rep < REPS; rep++) {
        struct rep r = rep_start();
#pragma omp parallel reduction(+:sink)
        {
            const vreg *buf = (const vreg *)bufs[omp_get_thread_num()];
            const size_t m = n * (sizeof(v16) / sizeof(vreg));
            vreg acc[READ_ACC] = {{0}};
            for (long p = 0; p < passes; p++) {
                for (size_t i = 0; i < m; i += READ_ACC) {
#pragma GCC unroll 8
                    for (int k = 0; k < READ_ACC; k++)
                        acc[k] += buf[i + k];
                }
                for (int k = 0; k < READ_ACC; k++)   /* no pass may be skipped or merged */
                    __asm__ volatile("" : "+v"(acc[k]));
            }
            float s = 0;
            for (int k = 0; k < READ_ACC; k++)
                for (size_t j = 0; j < LANES; j++)
                    s += acc[k][j];
            sink += s;
        }
        gbps[rep] = (double)passes * n * sizeof(v16) * threads / rep_end(r, threads, &share[rep]) / 1e9;
    }
    for (int t = 0; t < threads; t++)
        free(bufs[t]);
    free(bufs);
    return sink;
}

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

    double read_gbps[REPS], read_share[REPS], triad_gbps[REPS], triad_share[REPS];
    double fma_gflops[REPS], fma_share[REPS];
    float sink = 0;
    for (int rep = 0; rep < REPS; rep++) {
        struct rep r = rep_start();
        float s = 0;
#pragma omp parallel for schedule(static) reduction(+:s)
        for (size_t i = 0; i < n; i++)
            s += a[i];
        read_gbps[rep] = n * sizeof(float) / rep_end(r, threads, &read_share[rep]) / 1e9;
        sink += s;

        r = rep_start();
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++)
            a[i] = b[i] + 3.0f * c[i];
        triad_gbps[rep] = 3.0 * n * sizeof(float) / rep_end(r, threads, &triad_share[rep]) / 1e9;
    }

    const long iters = 20 * 1000 * 1000;
    const double fma_flops = (double)iters * ACC * 8 * 2 * threads;
    for (int rep = 0; rep < REPS; rep++) {
        struct rep r = rep_start();
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
        fma_gflops[rep] = fma_flops / rep_end(r, threads, &fma_share[rep]) / 1e9;
    }
    char names[MAX_LEVELS][32];
    double level_gbps[MAX_LEVELS][REPS], level_share[MAX_LEVELS][REPS];
    int levels = 0;
    for (int i = 3; i < argc && levels < MAX_LEVELS; i++, levels++) {
        const char *colon = strchr(argv[i], ':');
        size_t bytes = colon ? (size_t)atol(colon + 1) : 0;
        bytes -= bytes % (READ_ACC * sizeof(v16));
        if (!colon || colon - argv[i] >= 28 || bytes == 0)
            return 2;
        snprintf(names[levels], sizeof(names[levels]), "%.*s", (int)(colon - argv[i]), argv[i]);
        sink += cache_read(threads, bytes, level_gbps[levels], level_share[levels]);
    }
    printf("{\"threads\": %d, ", threads);
    print_series("read_gbps", read_gbps);
    print_series("read_cpu_share", read_share);
    print_series("triad_gbps", triad_gbps);
    print_series("triad_cpu_share", triad_share);
    print_series("fma_gflops", fma_gflops);
    print_series("fma_cpu_share", fma_share);
    for (int l = 0; l < levels; l++) {
        char key[48];
        snprintf(key, sizeof(key), "%.31s_gbps", names[l]);
        print_series(key, level_gbps[l]);
        snprintf(key, sizeof(key), "%.31s_cpu_share", names[l]);
        print_series(key, level_share[l]);
    }
    printf("\"sink\": %g}\n", (double)sink);
    return 0;
}
