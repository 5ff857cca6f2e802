/* What a uprobe's trap costs the work around it, not only the call it sits on: each call of
 * ta_probed (its first instruction a nop5, which the kernel emulates) is followed by a read of
 * LINES cache lines, either one per 4 KiB page ("spread": LINES pages, LINES TLB entries) or
 * packed together ("packed": the same lines in LINES / 64 pages). bench/trap_aftermath.py
 * puts a uprobe on ta_probed in alternate rounds: a hit's price grows with what the work
 * must fetch again after the kernel ran (its TLB entries, its cache lines).
 *
 * "code-packed" and "code-spread" run LINES cache lines of code instead, one a line or one a
 * page (as many instruction TLB entries).
 *
 * usage: trap_aftermath spread|packed|code-packed|code-spread LINES CALLS ROUNDS -- one line (ns per call, thread
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
    long lines = atol(argv[2]), calls = atol(argv[3]), rounds = atol(argv[4]);
    if (lines > SLED)
        return 2;
    long (*sled)(long) = (long (*)(long))((spread ? ta_sled_spread : ta_sled_packed)
                                          + (SLED - lines) * (spread ? 4096 : 64));
    long stride = spread ? 4096 + 64 : 64;      /* spread: another page, and another set */
    volatile unsigned char *buf = malloc(lines * stride + 4096);
    memset((void *)buf, 1, lines * stride + 4096);
    char line[16];
    long sink = 0;
    for (long r = 0; r < rounds; r++) {
        if (!fgets(line, sizeof(line), stdin))
            return 1;
        double t0 = now_ns();
        for (long c = 0; c < calls; c++) {
            sink = ta_probed(sink);
            if (code) {
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
