/* What a uprobe hit costs in a process like an engine's (bench/hit_in_process.py): hp_loop
 * calls hp_probed (its first instruction a nop5, which the kernel emulates) N times, plain or
 * with AVX2 / AVX-512 state live across the calls; hp_start adds a sibling thread that spins
 * or sleeps in short naps, as an OpenMP worker between parallel regions does, or maps and
 * unmaps memory. */
#include <immintrin.h>
#include <pthread.h>
#include <sys/mman.h>
#include <time.h>

__asm__(".text\n.globl hp_probed\n.type hp_probed,@function\nhp_probed:\n"
        ".byte 0x0f,0x1f,0x44,0x00,0x00\n lea 1(%rdi),%rax\n ret\n.size hp_probed,.-hp_probed\n");
long hp_probed(long x);

long hp_loop(long n)
{
    long (*volatile f)(long) = hp_probed, s = 0;
    for (long i = 0; i < n; i++)
        s = f(s);
    return s;
}

/* The loop with a vector register kept live across the calls (an FMA on it after each). */
#define HP_VECTOR_LOOP(name, isa, vec, set1, fmadd, store, lanes)                           \
    __attribute__((target(isa))) long name(long n)                                          \
    {                                                                                       \
        long (*volatile f)(long) = hp_probed, s = 0;                                        \
        vec a = set1(1.0001f), b = set1(0.9999f);                                           \
        for (long i = 0; i < n; i++) {                                                      \
            s = f(s);                                                                       \
            a = fmadd(a, b, b);                                                             \
        }                                                                                   \
        float out[lanes];                                                                   \
        store(out, a);                                                                      \
        return s + (long)out[0];                                                            \
    }
HP_VECTOR_LOOP(hp_loop_avx2, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_storeu_ps, 8)
HP_VECTOR_LOOP(hp_loop_avx512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps, 16)

static volatile long hp_sink;

static void *spin(void *arg)
{
    for (;;)
        hp_sink++;
    return arg;
}

static void *nap(void *arg)
{
    for (;;) {
        struct timespec ts = {0, 50000};
        nanosleep(&ts, 0);
        hp_sink++;
    }
    return arg;
}

/* As an allocator does with blocks above its mmap threshold: map, touch, unmap, in a loop;
 * each map and unmap takes the address space's lock for writing. */
static void *churn(void *arg)
{
    for (;;) {
        char *p = mmap(0, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            continue;
        p[0] = 1;
        munmap(p, 1 << 20);
        hp_sink++;
    }
    return arg;
}

/* sibling: 0 spins, 1 naps, 2 maps and unmaps memory */
void hp_start(int sibling)
{
    pthread_t t;
    pthread_create(&t, 0, sibling == 2 ? churn : sibling == 1 ? nap : spin, 0);
}
