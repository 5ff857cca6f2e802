// What one probed CUDA call costs its caller: calls one runtime function N times in a loop
// and prints the mean ns per call (CLOCK_MONOTONIC). Without a driver each call returns an
// error at once, so what a probe adds is most of what is measured, run against the same
// loop unprobed (bench/cuda_overhead.py).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <cuda_runtime.h>

__global__ void bench_kernel(float* x, int n) { if (x && n) x[0] = 1.0f; }

static long long now_ns() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(int argc, char** argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s launch|copy|malloc|sync N\n", argv[0]); return 2; }
    const char* what = argv[1];
    long n = atol(argv[2]);
    static char host[4096];
    float* dev = nullptr; int len = 1;
    void* args[2] = {&dev, &len};
    cudaStream_t stream = (cudaStream_t)0x5100;
    long long t0 = now_ns();
    for (long i = 0; i < n; i++) {
        if (!strcmp(what, "launch")) cudaLaunchKernel((const void*)bench_kernel, dim3(1), dim3(32), args, 0, stream);
        else if (!strcmp(what, "copy")) cudaMemcpyAsync((void*)0xd000000000, host, sizeof(host), cudaMemcpyHostToDevice, stream);
        else if (!strcmp(what, "malloc")) { void* p = nullptr; cudaMalloc(&p, 4096); }
        else if (!strcmp(what, "sync")) cudaStreamSynchronize(stream);
    }
    long long t1 = now_ns();
    printf("ns_per_call %.1f\n", (double)(t1 - t0) / n);
    return 0;
}
