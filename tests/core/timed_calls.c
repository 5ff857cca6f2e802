/* Calls one short function in bursts and logs each call's start and end (CLOCK_MONOTONIC ns)
 * as its own clock saw them: the truth a probe's cost inside a process is checked against.
 * `work` is written out so that its entry block has emulated instructions after its first
 * (push rbp; mov rbp,rsp; push rbx). Usage: timed_calls SECONDS LOG */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void work(void);
__asm__(".text\n.globl work\n.type work,@function\nwork:\n"
        "push %rbp\nmov %rsp,%rbp\npush %rbx\nmov $200,%ebx\n"
        "1: dec %ebx\njnz 1b\npop %rbx\npop %rbp\nret\n.size work,.-work\n");

static long ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000L + t.tv_nsec; }

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    long until = ns() + (long)(atof(argv[1]) * 1e9), cap = 4000000, n = 0;
    long *log = malloc(sizeof(long) * 2 * cap);
    struct timespec pause = {0, 1000000};
    printf("ready\n");
    fflush(stdout);
    while (n < cap && ns() < until) {
        for (int i = 0; i < 100 && n < cap; i++, n++) {
            log[2 * n] = ns();
            work();
            log[2 * n + 1] = ns();
        }
        nanosleep(&pause, NULL);
    }
    FILE *f = fopen(argv[2], "w");
    for (long i = 0; i < n; i++) fprintf(f, "%ld %ld\n", log[2 * i], log[2 * i + 1]);
    fclose(f);
    return 0;
}
