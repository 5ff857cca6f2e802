/* What a uprobe's trap costs the work around it, not only the call it sits on: each call of
 * ta_probed (its first instruction a nop5, which the kernel emulates) is followed by a read of
 * LINES cache lines, either one per 4 KiB page ("spread": LINES pages, LINES TLB entries) or
 * packed together ("packed": the same lines in LINES / 64 pages). bench/trap_aftermath.py
 * puts a uprobe on ta_probed in alternate rounds: a hit's price grows with what the work
 * must fetch again after the kernel ran (its TLB entries, its cache lines), or with what the
 * kernel's own trap path must fetch again after the work (for the data layouts LINES is not
 * bounded by the code sled: past L2).
 *
 * "code-packed" and "code-spread" run LINES cache lines of code instead, one a line or one a
 * page (as many instruction TLB entries).
 *
 * "branches" makes LINES indirect calls instead, in a fixed order (below).
 *
 * usage: trap_aftermath spread|packed|code-packed|code-spread|branches LINES CALLS ROUNDS -- one line (ns per call, thread
 * CPU time) per round, each after reading a line on stdin. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

__asm__(".text\n.globl ta_probed\n.type ta_probed,@function\nta_probed:\n"
        ".byte 0x0f,0x1f,0x44,0x00,0x00\n lea 1(%rdi),%rax\n ret\n.size ta_probed,.-ta_probed\n");
long ta_probed(long x);

/* Code to run after each call: a sled of SLED blocks (an instruction and a jump to the next,
 * the padding between never run), one block a cache line (packed) or a page (spread);
 * entered SLED - LINES blocks in, it runs LINES. */
#define SLED 1024
__asm__(".text\n.p2align 12\n.globl ta_sled_packed\nta_sled_packed:\n"
        ".rept 1024\n.p2align 6\n lea 1(%rdi),%rdi\n jmp 1f\n.p2align 6\n1:\n.endr\n mov %rdi,%rax\n ret\n"
        ".p2align 12\n.globl ta_sled_spread\nta_sled_spread:\n"
        ".rept 1024\n.p2align 12\n lea 1(%rdi),%rdi\n jmp 1f\n.p2align 12\n1:\n.endr\n mov %rdi,%rax\n ret\n");
extern char ta_sled_packed[], ta_sled_spread[];

/* "branches": LINES indirect calls after each call, through 16 functions in a fixed pseudo-random
 * order that the predictors learn within a round; a trap that clears them makes each cost a
 * misprediction again. */
#define FN(n) static __attribute__((noinline)) long ta_fn##n(long x) { __asm__ volatile(""); return x * (n + 3) + n; }
FN(0) FN(1) FN(2) FN(3) FN(4) FN(5) FN(6) FN(7) FN(8) FN(9) FN(10) FN(11) FN(12) FN(13) FN(14) FN(15)
static long (*const ta_fns[16])(long) = {ta_fn0, ta_fn1, ta_fn2, ta_fn3, ta_fn4, ta_fn5, ta_fn6, ta_fn7,
                                          ta_fn8, ta_fn9, ta_fn10, ta_fn11, ta_fn12, ta_fn13, ta_fn14, ta_fn15};

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 5)
        return 2;
    int spread = strstr(argv[1], "spread") != NULL, code = strncmp(argv[1], "code", 4) == 0;
    int branches = strcmp(argv[1], "branches") == 0;
    long lines = atol(argv[2]), calls = atol(argv[3]), rounds = atol(argv[4]);
    if (lines > SLED && (code || branches))
        return 2;
    long (*sled)(long) = code ? (long (*)(long))((spread ? ta_sled_spread : ta_sled_packed)
                                                 + (SLED - lines) * (spread ? 4096 : 64)) : 0;
    long stride = spread ? 4096 + 64 : 64;      /* spread: another page, and another set */
    volatile unsigned char *buf = malloc(lines * stride + 4096);
    memset((void *)buf, 1, lines * stride + 4096);
    unsigned char *order = malloc(lines + 1);
    unsigned long seed = 12345;
    for (long i = 0; i < lines; i++) {
        seed = seed * 6364136223846793005UL + 1442695040888963407UL;
        order[i] = (seed >> 33) & 15;
    }
    char line[16];
    long sink = 0;
    for (long r = 0; r < rounds; r++) {
        if (!fgets(line, sizeof(line), stdin))
            return 1;
        double t0 = now_ns();
        for (long c = 0; c < calls; c++) {
            sink = ta_probed(sink);
            if (branches) {
                for (long i = 0; i < lines; i++)
                    sink = ta_fns[order[i]](sink);
            } else if (code) {
                sink = sled(sink);
            } else {
                for (long i = 0; i < lines; i++)
                    sink += buf[i * stride];
            }
        }
        printf("%.1f\n", (now_ns() - t0) / calls);
        fflush(stdout);
    }
    return sink == 42;
}
