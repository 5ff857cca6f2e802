// cuda_ops: functions of the program act as an engine's "ops" (pi_op_attention, pi_op_mlp,
// pi_op_norm), each making a few CUDA runtime calls from inside, so a test can check that a
// profiler attributes each call to the op it was made in. Every call is logged as one JSON line,
// like cuda_calls does, with "op" the op's name (null for calls made outside any op).
//
//   cuda_ops --log FILE [--threads T (default 3)] [--layers L (default 4)] [--start-after FILE]
//
// T threads each loop over L layers calling attention, mlp, norm in that order, then make one
// cudaDeviceSynchronize outside any op. Per thread: L * (3 + 4 + 1) + 1 calls:
//   pi_op_attention: 2 x cudaLaunchKernel(attn_kernel) + 1 x cudaMemcpyAsync (host to device)
//   pi_op_mlp:       3 x cudaLaunchKernel(mlp_kernel) + 1 x cudaStreamSynchronize
//   pi_op_norm:      1 x cudaLaunchKernel(norm_kernel)
// Thread i (0-based) uses the fake stream kStreamBase + i * kStreamStep.
// --start-after FILE: print "ready <pid>", then wait (10 ms polls) until FILE exists.
// There is no driver where this is tested: the calls fail (cudaErrorInsufficientDriver), but
// are entered with their real arguments. Device pointers and streams are fake handles.
#include <cuda_runtime.h>

#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "call_log.h"

// ---------------------------------------------------------------------------------------
// The fixed numbers
// ---------------------------------------------------------------------------------------

static const uintptr_t kStreamBase = 0x5100, kStreamStep = 0x100;
static const uintptr_t kDevBase = 0xd000000000ull;  // fake device memory
static const int kElems = 4096;

// Kernels, and the names `nm -C` prints for their host stubs (checked by the tests).
static const char* const kAttnKernelName = "pi_ops::attn_kernel(float*, int)";
static const char* const kMlpKernelName = "pi_ops::mlp_kernel(float*, int)";
static const char* const kNormKernelName = "pi_ops::norm_kernel(float*, int)";

static const unsigned kAttnGrid[3] = {8, 4, 1}, kAttnBlock[3] = {128, 1, 1}, kAttnShmem = 4096;
static const unsigned kMlpGrid[3] = {16, 1, 1}, kMlpBlock[3] = {256, 1, 1}, kMlpShmem = 0;
static const unsigned kNormGrid[3] = {2, 2, 2}, kNormBlock[3] = {64, 2, 1}, kNormShmem = 512;
static const int kAttnLaunches = 2, kMlpLaunches = 3, kNormLaunches = 1;
// attention's copy: kAttnCopyBytes + layer bytes, host to device
static const size_t kAttnCopyBytes = 8192;
static const size_t kHostBufBytes = 64 * 1024;

// ---------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------

namespace pi_ops {
__global__ void attn_kernel(float* p, int layer) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < kElems) p[i] += (float)layer;
}
__global__ void mlp_kernel(float* p, int layer) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < kElems) p[i] *= (float)layer;
}
__global__ void norm_kernel(float* p, int layer) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < kElems) p[i] -= (float)layer;
}
}  // namespace pi_ops

// ---------------------------------------------------------------------------------------
// The ops
// ---------------------------------------------------------------------------------------

// Per thread: its stream and host buffer.
static thread_local cudaStream_t t_stream = 0;
static thread_local char* t_host = nullptr;
static thread_local int t_index = 0;

static inline __attribute__((always_inline)) void launch(const char* op, const void* func, const char* name, const unsigned* grid,
                   const unsigned* block, unsigned shmem, int layer) {
    float* p = (float*)(kDevBase + (uintptr_t)t_index * 0x1000000);
    void* args[2] = {&p, &layer};
    dim3 g(grid[0], grid[1], grid[2]), b(block[0], block[1], block[2]);
    int64_t t = now_ns();
    int ret = cudaLaunchKernel(func, g, b, args, shmem, t_stream);
    Line("cudaLaunchKernel", t, ret, op).str("kernel", name).hex("func", func).dims("grid", grid)
        .dims("block", block).num("shmem", shmem).hex("stream", (const void*)t_stream)
        .num("layer", layer).num("thread", t_index).emit();
}

// The cudart calls are made directly from the op functions' own bodies (`launch` is always
// inlined), so each call's return address lies in its op. noinline/noclone: the ops stay real
// functions, named as written in .symtab, and their callers call them, not a clone.
extern "C" __attribute__((noinline, noclone, used, visibility("default"))) void pi_op_attention(int layer) {
    static const char* const op = "pi_op_attention";
    for (int i = 0; i < kAttnLaunches; i++)
        launch(op, (const void*)pi_ops::attn_kernel, kAttnKernelName, kAttnGrid, kAttnBlock,
               kAttnShmem, layer);
    void* dst = (void*)(kDevBase + (uintptr_t)t_index * 0x1000000 + 0x100000);
    size_t bytes = kAttnCopyBytes + layer;
    int64_t t = now_ns();
    int ret = cudaMemcpyAsync(dst, t_host, bytes, cudaMemcpyHostToDevice, t_stream);
    Line("cudaMemcpyAsync", t, ret, op).num("bytes", bytes).num("kind", cudaMemcpyHostToDevice)
        .hex("dst", dst).hex("src", t_host).hex("stream", (const void*)t_stream)
        .num("layer", layer).num("thread", t_index).emit();
}

extern "C" __attribute__((noinline, noclone, used, visibility("default"))) void pi_op_mlp(int layer) {
    static const char* const op = "pi_op_mlp";
    for (int i = 0; i < kMlpLaunches; i++)
        launch(op, (const void*)pi_ops::mlp_kernel, kMlpKernelName, kMlpGrid, kMlpBlock,
               kMlpShmem, layer);
    int64_t t = now_ns();
    int ret = cudaStreamSynchronize(t_stream);
    Line("cudaStreamSynchronize", t, ret, op).hex("stream", (const void*)t_stream)
        .num("layer", layer).num("thread", t_index).emit();
}

extern "C" __attribute__((noinline, noclone, used, visibility("default"))) void pi_op_norm(int layer) {
    static const char* const op = "pi_op_norm";
    for (int i = 0; i < kNormLaunches; i++)
        launch(op, (const void*)pi_ops::norm_kernel, kNormKernelName, kNormGrid, kNormBlock,
               kNormShmem, layer);
}

static void worker(int index, int layers) {
    t_index = index;
    t_stream = (cudaStream_t)(kStreamBase + (uintptr_t)index * kStreamStep);
    t_host = (char*)calloc(1, kHostBufBytes);
    for (int layer = 0; layer < layers; layer++) {
        pi_op_attention(layer);
        pi_op_mlp(layer);
        pi_op_norm(layer);
    }
    int64_t t = now_ns();
    int ret = cudaDeviceSynchronize();
    Line("cudaDeviceSynchronize", t, ret, nullptr).num("thread", index).emit();
    free(t_host);
}

static int usage() {
    fprintf(stderr, "usage: cuda_ops --log FILE [--threads T] [--layers L] [--start-after FILE]\n");
    return 2;
}

int main(int argc, char** argv) {
    const char* log_path = nullptr;
    const char* start_after = nullptr;
    int threads = 3, layers = 4;
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (i + 1 >= argc) return usage();
        if (!strcmp(a, "--log")) log_path = argv[++i];
        else if (!strcmp(a, "--threads")) threads = atoi(argv[++i]);
        else if (!strcmp(a, "--layers")) layers = atoi(argv[++i]);
        else if (!strcmp(a, "--start-after")) start_after = argv[++i];
        else return usage();
    }
    if (!log_path || threads < 1 || layers < 0) return usage();

    g_log = fopen(log_path, "w");
    if (!g_log) {
        perror(log_path);
        return 2;
    }
    atexit(flush_log);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    signal(SIGSEGV, on_signal);
    signal(SIGBUS, on_signal);
    signal(SIGABRT, on_signal);

    if (start_after) {
        printf("ready %d\n", (int)getpid());
        fflush(stdout);
        while (access(start_after, F_OK) != 0) usleep(10000);
    }

    std::vector<std::thread> pool;
    for (int i = 0; i < threads; i++) pool.emplace_back(worker, i, layers);
    for (auto& th : pool) th.join();
    flush_log();
    return 0;
}
