// The test programs' own log: one JSON object per CUDA call they make, what the tests
// compare a recording with. Shared by cuda_calls.cu and cuda_ops.cu.
#pragma once

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <string>
#include <unistd.h>

static FILE* g_log = nullptr;
static std::mutex g_log_mutex;

static void flush_log() {
    if (g_log) fflush(g_log);
}

static void on_signal(int sig) {  // keeps the lines logged so far, even on a crash
    flush_log();
    signal(sig, SIG_DFL);
    raise(sig);
}

static int64_t now_ns() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// One call: {"fn": ..., "tid": ..., "t_ns": ..., "ret": ..., "op": ..., then its fields}.
struct Line {
    std::string s;
    Line(const char* fn, int64_t t_ns, int ret, const char* op = nullptr) {
        char b[256];
        snprintf(b, sizeof b, "{\"fn\": \"%s\", \"tid\": %d, \"t_ns\": %lld, \"ret\": %d, \"op\": ",
                 fn, (int)gettid(), (long long)t_ns, ret);
        s = b;
        if (op) {
            s += "\"";
            s += op;
            s += "\"";
        } else {
            s += "null";
        }
    }
    Line& str(const char* k, const char* v) {  // v: no characters that need escaping
        s += ", \"";
        s += k;
        s += "\": \"";
        s += v;
        s += "\"";
        return *this;
    }
    Line& num(const char* k, unsigned long long v) {
        char b[96];
        snprintf(b, sizeof b, ", \"%s\": %llu", k, v);
        s += b;
        return *this;
    }
    Line& hex(const char* k, uintptr_t v) {
        char b[96];
        snprintf(b, sizeof b, ", \"%s\": \"0x%llx\"", k, (unsigned long long)v);
        s += b;
        return *this;
    }
    Line& hex(const char* k, const void* v) { return hex(k, (uintptr_t)v); }
    Line& dims(const char* k, unsigned x, unsigned y, unsigned z) {
        char b[96];
        snprintf(b, sizeof b, ", \"%s\": [%u, %u, %u]", k, x, y, z);
        s += b;
        return *this;
    }
    Line& dims(const char* k, const unsigned* d) { return dims(k, d[0], d[1], d[2]); }
    void emit() {
        s += "}\n";
        std::lock_guard<std::mutex> g(g_log_mutex);
        fputs(s.c_str(), g_log);
    }
};

