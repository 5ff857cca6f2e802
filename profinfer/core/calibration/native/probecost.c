/* What one uprobe hit costs this thread: calls a tiny function `calls` times and prints the
 * thread CPU time per call (ns). profinfer attaches a uprobe (or uretprobe) to the function
 * between runs; the difference is the probe's cost, trap and all.
 *
 * usage: probecost FUNCTION CALLS ROUNDS  -- prints one line per round after reading a line
 * on stdin (the probe goes in or out between rounds). FUNCTION: emulated | stepped
 *   emulated: starts with push %rbx, which the x86 kernel emulates at a uprobe
 *   stepped:  starts with mov %rdi,%rax, which it must single-step out of line */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

long pi_probe_emulated(long x);
long pi_probe_stepped(long x);
__asm__(".text\n"
        ".globl pi_probe_emulated\n.type pi_probe_emulated,@function\n"
        "pi_probe_emulated:\n push %rbx\n lea 1(%rdi),%rax\n pop %rbx\n ret\n"
        ".size pi_probe_emulated,.-pi_probe_emulated\n"
        ".globl pi_probe_stepped\n.type pi_probe_stepped,@function\n"
        "pi_probe_stepped:\n mov %rdi,%rax\n add $1,%rax\n ret\n"
        ".size pi_probe_stepped,.-pi_probe_stepped\n");

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
    long (*volatile fn)(long) = strcmp(argv[1], "stepped") ? pi_probe_emulated : pi_probe_stepped;
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
