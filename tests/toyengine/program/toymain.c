/* The toy engine's program: loads libtoyengine and generates SEQS sequences one after the
 * other, each a prompt of PROMPT tokens in one decode call, then GEN calls of one token.
 * It logs each decode call's times as its caller sees them:
 *   call SEQ POS0 N CALLER_START CALLER_END
 * Usage: toymain LOG [--wait]  (--wait: a line on stdin first, so a watcher can find it). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

int toy_decode(int seq, int pos0, int n_tokens);
void toy_log_to(FILE *f);

#define SEQS 2
#define PROMPT 6
#define GEN 8

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void run(FILE *log, int seq, int pos0, int n)
{
    uint64_t a = now_ns();
    int ret = toy_decode(seq, pos0, n);
    uint64_t b = now_ns();
    fprintf(log, "call %d %d %d %lu %lu %d\n", seq, pos0, n, (unsigned long)a, (unsigned long)b, ret);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: toymain LOG [--wait]\n");
        return 2;
    }
    FILE *log = fopen(argv[1], "w");
    if (!log) {
        perror(argv[1]);
        return 1;
    }
    if (argc > 2 && strcmp(argv[2], "--wait") == 0) {
        char line[64];
        printf("ready\n");
        fflush(stdout);
        if (!fgets(line, sizeof(line), stdin))
            return 1;
    }
    toy_log_to(log);
    for (int seq = 0; seq < SEQS; seq++) {
        run(log, seq, 0, PROMPT);
        for (int i = 0; i < GEN; i++)
            run(log, seq, PROMPT + i, 1);
    }
    fclose(log);
    return 0;
}
