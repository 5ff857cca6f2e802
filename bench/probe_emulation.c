/* Which instructions the kernel emulates at a uprobe, and what a hit on each costs:
 * bench/probe_emulation.py puts a uprobe on the first instruction of one of these functions
 * for alternate rounds and takes the difference in thread CPU time per call.
 *
 * usage: probe_emulation FUNCTION CALLS ROUNDS -- one line (ns per call) per round, each after
 * reading a line on stdin. FUNCTION: a name of the table below. Each function returns x + 1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FN(name, first) ".globl pe_" #name "\n.type pe_" #name ",@function\npe_" #name ":\n" \
    first "\n lea 1(%rdi),%rax\n ret\n.size pe_" #name ",.-pe_" #name "\n"
/* the instruction measured comes first; anything it pushed is popped before the lea */
__asm__(".text\n"
    FN(push_rbx,      "push %rbx\n pop %rbx")
    FN(push_r12,      "push %r12\n pop %r12")
    FN(push_rbp,      "push %rbp\n pop %rbp")
    FN(endbr64,       ".byte 0xf3,0x0f,0x1e,0xfa")
    FN(nop1,          ".byte 0x90")
    FN(xchg_ax_ax,    ".byte 0x66,0x90")
    FN(nopl3,         ".byte 0x0f,0x1f,0x00")
    FN(nopl4,         ".byte 0x0f,0x1f,0x40,0x00")
    FN(nop5,          ".byte 0x0f,0x1f,0x44,0x00,0x00")
    FN(nopw6,         ".byte 0x66,0x0f,0x1f,0x44,0x00,0x00")
    FN(nopl7,         ".byte 0x0f,0x1f,0x80,0x00,0x00,0x00,0x00")
    FN(nopl8,         ".byte 0x0f,0x1f,0x84,0x00,0x00,0x00,0x00,0x00")
    FN(nopw9,         ".byte 0x66,0x0f,0x1f,0x84,0x00,0x00,0x00,0x00,0x00")
    FN(nopw_cs10,     ".byte 0x66,0x2e,0x0f,0x1f,0x84,0x00,0x00,0x00,0x00,0x00")
    FN(jmp_rel8,      ".byte 0xeb,0x00")
    FN(jmp_rel32,     ".byte 0xe9,0x00,0x00,0x00,0x00")
    FN(jcc_rel8,      "test %rdi,%rdi\n jz 1f\n1:")          /* probed at +3: see TABLE */
    FN(jrcxz,         ".byte 0xe3,0x00")
    FN(loop,          ".byte 0xe2,0x00")
    FN(jcc_rel32,     "test %rdi,%rdi\n .byte 0x0f,0x84,0x00,0x00,0x00,0x00")   /* probed at +3 */
    FN(call_rel32,    "call 1f\n1: add $8,%rsp")
    FN(mov_rdi_rax,   "mov %rdi,%rax")
    FN(sub_rsp,       "sub $8,%rsp\n add $8,%rsp")
    FN(lea_r10_rsp,   "lea 8(%rsp),%r10")
    FN(mov_rsp_rbp,   "push %rbp\n mov %rsp,%rbp\n pop %rbp")   /* probed at +1 */
    FN(push_imm,      "push $0\n add $8,%rsp")
);

#define DECL(name) long pe_##name(long);
#define ROW(name) {#name, pe_##name},
#define NAMES(X) X(push_rbx) X(push_r12) X(push_rbp) X(endbr64) X(nop1) X(xchg_ax_ax) X(nopl3) \
    X(nopl4) X(nop5) X(nopw6) X(nopl7) X(nopl8) X(nopw9) X(nopw_cs10) X(jmp_rel8) X(jmp_rel32) \
    X(jcc_rel8) X(jrcxz) X(loop) X(jcc_rel32) X(call_rel32) X(mov_rdi_rax) X(sub_rsp) X(lea_r10_rsp) X(mov_rsp_rbp) X(push_imm)
NAMES(DECL)
static const struct { const char *name; long (*fn)(long); } TABLE[] = { NAMES(ROW) };

static double thread_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    long (*volatile fn)(long) = NULL;
    for (size_t i = 0; i < sizeof TABLE / sizeof TABLE[0]; i++)
        if (!strcmp(TABLE[i].name, argv[1]))
            fn = TABLE[i].fn;
    if (!fn)
        return 2;
    long calls = atol(argv[2]), rounds = atol(argv[3]), sink = 0;
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (long r = 0; r < rounds; r++) {
        if (!fgets(line, sizeof line, stdin))
            return 0;
        double t0 = thread_ns();
        for (long i = 0; i < calls; i++)
            sink = fn(sink);
        printf("%.3f\n", (thread_ns() - t0) / calls);
    }
    return sink == calls * rounds ? 0 : 1;
}
