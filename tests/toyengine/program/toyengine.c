/* The toy engine's library: toy_decode(seq, pos0, n_tokens) runs one batch of n_tokens of
 * sequence `seq` from position pos0, as OPS_PER_CALL calls of toy_op(op, n_tokens). It logs
 * the times (CLOCK_MONOTONIC, the clock bpf_ktime_get_ns reads) each function takes of itself
 * and its caller around each call, to the log the program set:
 *   opself OP OWN_START OWN_END                (toy_op, just before it returns)
 *   opcall OP TID CALLER_START CALLER_END      (toy_decode, after each toy_op call)
 *   decode SEQ POS0 N TID OWN_START OWN_END    (toy_decode, just before it returns)
 * so a probe's times must fall between the function's own and its caller's. */
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static FILE *toy_log;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void toy_log_to(FILE *f)
{
    toy_log = f;
}

/* The op sequence of one decode call: an embedding, then two layers of attention and a
 * projection (the pack names op numbers 0, 1 and 2). */
static const int OPS[] = {0, 1, 2, 1, 2};
#define OPS_PER_CALL (int)(sizeof(OPS) / sizeof(OPS[0]))

__attribute__((noinline, noclone)) long toy_op(int op, int n_tokens)
{
    uint64_t t0 = now_ns();
    volatile long acc = op;
    for (long i = 0; i < 20000L * (op + 1) * n_tokens; i++)
        acc += i ^ op;
    uint64_t t1 = now_ns();
    if (toy_log)
        fprintf(toy_log, "opself %d %lu %lu\n", op, (unsigned long)t0, (unsigned long)t1);
    return acc;
}

__attribute__((noinline, noclone)) int toy_decode(int seq, int pos0, int n_tokens)
{
    uint64_t t0 = now_ns();
    long sum = 0;
    long tid = syscall(SYS_gettid);
    for (int i = 0; i < OPS_PER_CALL; i++) {
        uint64_t a = now_ns();
        sum += toy_op(OPS[i], n_tokens);
        uint64_t b = now_ns();
        if (toy_log)
            fprintf(toy_log, "opcall %d %ld %lu %lu\n", OPS[i], tid, (unsigned long)a, (unsigned long)b);
    }
    uint64_t t1 = now_ns();
    if (toy_log)
        fprintf(toy_log, "decode %d %d %d %ld %lu %lu\n", seq, pos0, n_tokens, tid,
                (unsigned long)t0, (unsigned long)t1);
    return sum == 42 ? 1 : 0;     /* 0, as an engine's success; the sum keeps the work */
}
