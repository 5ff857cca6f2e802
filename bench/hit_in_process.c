/* What a uprobe hit costs in a process like an engine's (bench/hit_in_process.py): hp_loop
 * calls hp_probed (its first instruction a nop5, which the kernel emulates) N times, plain or
 * with AVX2 / AVX-512 state live across the calls; hp_start adds a sibling thread that spins
 * or sleeps in short naps, as an OpenMP worker between parallel regions does. */
#include <immintrin.h>
#include <pthread.h>
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

__attribute__((target("avx2,fma"))) long hp_loop_avx2(long n)
{
    long (*volatile f)(long) = hp_probed, s = 0;
    __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
    for (long i = 0; i < n; i++) {
        s = f(s);
        a = _mm256_fmadd_ps(a, b, b);
    }
    float out[8];
    _mm256_storeu_ps(out, a);
    return s + (long)out[0];
}

__attribute__((target("avx512f"))) long hp_loop_avx512(long n)
{
    long (*volatile f)(long) = hp_probed, s = 0;
    __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
    for (long i = 0; i < n; i++) {
        s = f(s);
        a = _mm512_fmadd_ps(a, b, b);
    }
    float out[16];
    _mm512_storeu_ps(out, a);
    return s + (long)out[0];
}

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

void hp_start(int napping)
{
    pthread_t t;
    pthread_create(&t, 0, napping ? nap : spin, 0);
}
