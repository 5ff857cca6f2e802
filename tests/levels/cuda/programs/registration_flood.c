/* A tenant's own "libcudart.so.12" (built with -DSTUB_RUNTIME: a bare __cudaRegisterFunction)
 * and a program that registers N kernels through it, each with a distinct host pointer and a
 * distinct 120-byte name: what a tenant could loop to grow an agent that names every kernel
 * registered, paced (argv[2] a millisecond, as a program registering its kernels does: not so
 * fast that an agent's event buffer overflows and it learns nothing). Prints "registered N"
 * and exits 0. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void __cudaRegisterFunction(void **fatbin, const char *host, char *device, const char *name, int limit,
                            void *tid, void *bid, void *bdim, void *gdim, int *wsize)
#ifdef STUB_RUNTIME
{
    (void)fatbin, (void)host, (void)device, (void)name, (void)limit;
    (void)tid, (void)bid, (void)bdim, (void)gdim, (void)wsize;
}
#else
;

#define NAME 120

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000;
    long per_ms = argc > 2 ? atol(argv[2]) : n;
    struct timespec ms = {0, 1000000};
    char *names = malloc((size_t)n * NAME);
    if (!names)
        return 1;
    for (long i = 0; i < n; i++) {
        char *name = names + i * NAME;
        snprintf(name, NAME, "_Z%ldkernel_of_a_tenant_that_registers_without_end_%0*ld", 60L, 60, i);
        __cudaRegisterFunction(0, (const char *)(0x100000 + i * 16), name, name, -1, 0, 0, 0, 0, 0);
        if (per_ms > 0 && (i + 1) % per_ms == 0)
            nanosleep(&ms, 0);
    }
    printf("registered %ld\n", n);
    return 0;
}
#endif
