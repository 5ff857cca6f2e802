// cuda_calls: a fixed, known sequence of CUDA runtime (and optionally driver) calls, each
// logged as one JSON line, so a test can compare what a profiler recorded with this log.
//
//   cuda_calls --log FILE [--runtime linked | --runtime dlopen:PATH] [--libcuda PATH]
//              [--start-after FILE] [--repeat R | --until FILE] [--libcuda-early]
//
// --runtime linked (default)  call the cudart this program is linked with (static or shared)
// --runtime dlopen:PATH       dlopen(PATH) (e.g. libcudart.so.12) and call it through dlsym;
//                             <<<>>> launches (they would go to the linked runtime) are skipped
// --libcuda PATH              also make the driver-API calls (dlopen PATH, dlsym the functions)
// --start-after FILE          print "ready <pid>", then wait (10 ms polls) until FILE exists
// --libcuda-early             dlopen --libcuda's PATH before that wait, not after it (a daemon
//                             that finds processes by scanning /proc alone sees it mapped)
// --repeat R                  make the whole sequence R times (default 1)
// --until FILE                make it until FILE exists (looked for between sequences), then
//                             print "syncs <calls> <ns>" (the synchronising calls, timed
//                             around each) and "repeats <n>": as long as a test needs, counted
//                             exactly
//
// Log: one JSON object per line, one per CUDA call made, in call order:
//   {"fn": ..., "tid": gettid(), "t_ns": CLOCK_MONOTONIC just before the call, "ret": int,
//    "op": null, ...call-specific fields}
// There is no GPU/driver where this is tested: the calls fail (cudaErrorInsufficientDriver),
// but they are entered with their real arguments, which is what a profiler's uprobes read.
// Device pointers, streams, events, graphs and modules are fake, fixed handles.
//
// Note on <<<>>>: CUDA 13's nvcc stub calls __cudaGetKernel(&handle, stub) once per kernel,
// then __cudaLaunchKernel(handle, ...), which in libcudart jumps to cudaLaunchKernel. Without
// a driver, __cudaGetKernel leaves handle == the host stub address, so cudaLaunchKernel sees
// func == the stub, as logged here. Its "ret" is cudaGetLastError() read right after the
// launch (cudaGetLastError itself is not logged: it is bookkeeping, like the push/pop of the
// launch configuration that <<<>>> also makes).
#include <cuda_runtime.h>
#include <cuda.h>   // driver API types only: libcuda is dlopen'ed, never linked

#include <dlfcn.h>
#include <signal.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <string>

#include "call_log.h"

// ---------------------------------------------------------------------------------------
// The fixed numbers of the sequence
// ---------------------------------------------------------------------------------------

// Fake handles: not real objects; the runtime fails before it would look at them.
static const uintptr_t kStreamA = 0x5100, kStreamB = 0x5200, kCaptureStream = 0x5300;
static const uintptr_t kEvent = 0x6100;
static const uintptr_t kModule = 0x7100;
// libcuda's cuLaunchKernel reads the first word of the CUfunction before it checks that the
// driver is initialised (it crashes on an unmapped handle): with --libcuda a zeroed, read-only
// page is mapped at this sentinel (0xF00D itself is below mmap_min_addr).
static const uintptr_t kDriverFuncSentinel = 0xF00D0000;
static const uintptr_t kGraphSentinel = 0x8100, kExecSentinel = 0x8200;
static const uintptr_t kDevBase = 0xd000000000ull;  // fake device memory
static const uintptr_t kDevA = kDevBase, kDevB = kDevBase + 0x1000000;

// Kernels, and the names `nm -C` prints for their host stubs (checked by the tests).
enum { K_SCALE = 0, K_ADD_N = 1, K_PLAIN_FILL = 2 };
static const char* const kKernelNames[3] = {
    "void pi_test::scale<float>(float*, float, int)",
    "void pi_test::inner::add_n<4>(int*, int)",
    "plain_fill(float*, int)",
};
static const float kScaleFactor = 1.5f;
static const int kElems = 1024;

// Launches, made once per launch mode (<<<>>>, cudaLaunchKernel, cudaLaunchKernelExC):
// 5 x scale<float>, 3 x add_n<4>, 2 x plain_fill. Mode m adds kModeGridX[m] to grid.x, so
// that every launch of the sequence has its own grid.
struct LaunchSpec {
    int kernel;
    unsigned grid[3], block[3];
    unsigned shmem;
    uintptr_t stream;
};
static const int kLaunchesPerMode = 10;
static const LaunchSpec kLaunches[kLaunchesPerMode] = {
    {K_SCALE,      {1, 1, 1},  {32, 1, 1},  0,    0},
    {K_SCALE,      {2, 3, 1},  {64, 1, 1},  128,  kStreamA},
    {K_SCALE,      {4, 2, 2},  {32, 4, 1},  256,  kStreamB},
    {K_SCALE,      {7, 1, 1},  {128, 1, 1}, 0,    kStreamA},
    {K_SCALE,      {9, 5, 3},  {16, 8, 2},  512,  0},
    {K_ADD_N,      {3, 1, 1},  {96, 1, 1},  64,   kStreamB},
    {K_ADD_N,      {5, 4, 1},  {8, 8, 1},   0,    0},
    {K_ADD_N,      {6, 6, 6},  {4, 4, 4},   1024, kStreamA},
    {K_PLAIN_FILL, {11, 1, 1}, {256, 1, 1}, 0,    kStreamB},
    {K_PLAIN_FILL, {13, 2, 1}, {32, 2, 1},  2048, 0},
};
enum { MODE_CHEVRON = 0, MODE_LAUNCH_KERNEL = 1, MODE_LAUNCH_KERNEL_EXC = 2 };
static const unsigned kModeGridX[3] = {0, 100, 200};

// Driver API (with --libcuda): cuInit(0), cuModuleGetFunction(kModule, kDriverFuncName),
// then 4 x cuLaunchKernel and 1 x cuLaunchKernelEx of that function.
static const char* const kDriverFuncName = "pi_driver_fn";
struct DriverLaunchSpec {
    unsigned grid[3], block[3];
    unsigned shmem;
    uintptr_t stream;
};
static const int kDriverLaunches = 4;
static const DriverLaunchSpec kDriverLaunchSpecs[kDriverLaunches] = {
    {{21, 1, 1}, {64, 1, 1},  0,   0},
    {{22, 2, 1}, {32, 2, 1},  96,  kStreamA},
    {{23, 3, 3}, {16, 4, 2},  192, kStreamB},
    {{24, 1, 1}, {128, 1, 1}, 384, kStreamA},
};
static const DriverLaunchSpec kDriverLaunchExSpec = {{25, 5, 1}, {64, 2, 1}, 768, kStreamB};

// Copies: cudaMemcpy of each kind 0..4 (H2H, H2D, D2H, D2D, Default), distinct sizes.
static const size_t kMemcpyBytes[5] = {1000, 2000, 3000, 4000, 5000};
// 2 x cudaMemcpyAsync: {bytes, kind, stream}
struct AsyncCopySpec { size_t bytes; int kind; uintptr_t stream; };
static const AsyncCopySpec kMemcpyAsync[2] = {{6000, cudaMemcpyHostToDevice, kStreamA},
                                              {7000, cudaMemcpyDeviceToHost, kStreamB}};
// cudaMemcpy2D (host to device) and cudaMemcpy2DAsync (device to host, on kStreamB)
static const size_t kCopy2DWidth = 96, kCopy2DHeight = 32, kCopy2DDpitch = 128, kCopy2DSpitch = 96;
static const size_t kCopy2DAsyncWidth = 160, kCopy2DAsyncHeight = 24, kCopy2DAsyncDpitch = 160,
                    kCopy2DAsyncSpitch = 256;
// 2 x cudaMemsetAsync (on kStreamA, kStreamB) and 1 x cudaMemset
static const size_t kMemsetAsyncBytes[2] = {9000, 10000};
static const size_t kMemsetBytes = 11000;
static const int kMemsetValue = 0x5a;
static const size_t kHostBufBytes = 64 * 1024;

// Memory: M cudaMalloc, each with its pointer pre-set to its own sentinel, then cudaFree of
// the first M - K sentinels (K left allocated).
static const int kMallocs = 6, kLeaked = 2;
static const uintptr_t kMallocSentinelBase = 0xd1000000, kMallocSentinelStep = 0x100000;
static const size_t kMallocSizes[kMallocs] = {1 << 20, 2 << 20, 4 << 20, 65536, 12345, 999999};
static const size_t kMallocHostBytes = 77777;
static const uintptr_t kMallocHostSentinel = 0xa1000000;
static const size_t kHostAllocBytes = 88888;
static const unsigned kHostAllocFlags = cudaHostAllocPortable;
static const uintptr_t kHostAllocSentinel = 0xa2000000;
static const size_t kMallocAsyncBytes = 123456;
static const uintptr_t kMallocAsyncSentinel = 0xd3000000;
static const uintptr_t kMallocAsyncStream = kStreamB;

// Graph: capture 2 cudaLaunchKernel on kCaptureStream, end, instantiate, launch G times.
static const LaunchSpec kCaptureLaunches[2] = {
    {K_PLAIN_FILL, {31, 1, 1}, {64, 1, 1}, 0,  kCaptureStream},
    {K_ADD_N,      {32, 2, 1}, {32, 1, 1}, 32, kCaptureStream},
};
static const int kGraphLaunches = 3;

// ---------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------

namespace pi_test {
template <typename T>
__global__ void scale(T* p, T s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] *= s;
}
namespace inner {
template <int N>
__global__ void add_n(int* p, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += N;
}
}  // namespace inner
}  // namespace pi_test

__global__ void plain_fill(float* p, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = 1.0f;
}

template __global__ void pi_test::scale<float>(float*, float, int);
template __global__ void pi_test::inner::add_n<4>(int*, int);

static const void* kernel_func(int k) {
    switch (k) {
        case K_SCALE: return (const void*)pi_test::scale<float>;
        case K_ADD_N: return (const void*)pi_test::inner::add_n<4>;
        default: return (const void*)plain_fill;
    }
}

// ---------------------------------------------------------------------------------------
// The runtime functions, linked or dlsym'ed
// ---------------------------------------------------------------------------------------

#define PI_RT_FUNCS(X)                                                                        \
    X(cudaLaunchKernel, (const void*, dim3, dim3, void**, size_t, cudaStream_t))            \
    X(cudaLaunchKernelExC, (const cudaLaunchConfig_t*, const void*, void**))                 \
    X(cudaMemcpy, (void*, const void*, size_t, cudaMemcpyKind))                              \
    X(cudaMemcpyAsync, (void*, const void*, size_t, cudaMemcpyKind, cudaStream_t))           \
    X(cudaMemcpy2D, (void*, size_t, const void*, size_t, size_t, size_t, cudaMemcpyKind))    \
    X(cudaMemcpy2DAsync,                                                                      \
      (void*, size_t, const void*, size_t, size_t, size_t, cudaMemcpyKind, cudaStream_t))    \
    X(cudaMemset, (void*, int, size_t))                                                       \
    X(cudaMemsetAsync, (void*, int, size_t, cudaStream_t))                                    \
    X(cudaMalloc, (void**, size_t))                                                           \
    X(cudaFree, (void*))                                                                      \
    X(cudaMallocHost, (void**, size_t))                                                       \
    X(cudaFreeHost, (void*))                                                                  \
    X(cudaHostAlloc, (void**, size_t, unsigned int))                                          \
    X(cudaMallocAsync, (void**, size_t, cudaStream_t))                                        \
    X(cudaFreeAsync, (void*, cudaStream_t))                                                   \
    X(cudaDeviceSynchronize, (void))                                                          \
    X(cudaStreamSynchronize, (cudaStream_t))                                                  \
    X(cudaEventSynchronize, (cudaEvent_t))                                                    \
    X(cudaStreamWaitEvent, (cudaStream_t, cudaEvent_t, unsigned int))                         \
    X(cudaStreamBeginCapture, (cudaStream_t, cudaStreamCaptureMode))                          \
    X(cudaStreamEndCapture, (cudaStream_t, cudaGraph_t*))                                     \
    X(cudaGraphInstantiate, (cudaGraphExec_t*, cudaGraph_t, unsigned long long))              \
    X(cudaGraphLaunch, (cudaGraphExec_t, cudaStream_t))

#define PI_TYPEDEF(name, args) typedef cudaError_t(*pfn_##name) args;
PI_RT_FUNCS(PI_TYPEDEF)
#undef PI_TYPEDEF

struct Runtime {
#define PI_MEMBER(name, args) pfn_##name name;
    PI_RT_FUNCS(PI_MEMBER)
#undef PI_MEMBER
};

static void runtime_linked(Runtime* rt) {
    // static_cast picks the C function out of the C++ template overloads (cudaMalloc<T> ...)
#define PI_LINKED(name, args) rt->name = static_cast<pfn_##name>(&::name);
    PI_RT_FUNCS(PI_LINKED)
#undef PI_LINKED
}

static bool runtime_dlopen(Runtime* rt, const char* path) {
    void* h = dlopen(path, RTLD_NOW);
    if (!h) {
        fprintf(stderr, "cuda_calls: dlopen %s: %s\n", path, dlerror());
        return false;
    }
    bool ok = true;
#define PI_DLSYM(name, args)                                                       \
    rt->name = reinterpret_cast<pfn_##name>(dlsym(h, #name));                     \
    if (!rt->name) {                                                               \
        fprintf(stderr, "cuda_calls: %s: no %s\n", path, #name);                 \
        ok = false;                                                                \
    }
    PI_RT_FUNCS(PI_DLSYM)
#undef PI_DLSYM
    return ok;
}

// The driver API (types from cuda.h; the functions from dlsym)
typedef CUresult (*pfn_cuInit)(unsigned int);
typedef CUresult (*pfn_cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
typedef CUresult (*pfn_cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                                       unsigned, unsigned, unsigned, CUstream, void**, void**);
typedef CUresult (*pfn_cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);

struct Driver {
    pfn_cuInit cuInit;
    pfn_cuModuleGetFunction cuModuleGetFunction;
    pfn_cuLaunchKernel cuLaunchKernel;
    pfn_cuLaunchKernelEx cuLaunchKernelEx;
};

static bool driver_dlopen(Driver* d, const char* path) {
    void* h = dlopen(path, RTLD_NOW);
    if (!h) {
        fprintf(stderr, "cuda_calls: dlopen %s: %s\n", path, dlerror());
        return false;
    }
    d->cuInit = reinterpret_cast<pfn_cuInit>(dlsym(h, "cuInit"));
    d->cuModuleGetFunction = reinterpret_cast<pfn_cuModuleGetFunction>(dlsym(h, "cuModuleGetFunction"));
    d->cuLaunchKernel = reinterpret_cast<pfn_cuLaunchKernel>(dlsym(h, "cuLaunchKernel"));
    d->cuLaunchKernelEx = reinterpret_cast<pfn_cuLaunchKernelEx>(dlsym(h, "cuLaunchKernelEx"));
    if (!d->cuInit || !d->cuModuleGetFunction || !d->cuLaunchKernel || !d->cuLaunchKernelEx) {
        fprintf(stderr, "cuda_calls: %s lacks a driver function\n", path);
        return false;
    }
    void* page = mmap((void*)kDriverFuncSentinel, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (page != (void*)kDriverFuncSentinel) {
        fprintf(stderr, "cuda_calls: cannot map the CUfunction sentinel page at 0x%llx\n",
                (unsigned long long)kDriverFuncSentinel);
        return false;
    }
    return true;
}

// ---------------------------------------------------------------------------------------
// The sequence
// ---------------------------------------------------------------------------------------

static float* const kDevFloats = (float*)kDevA;
static int* const kDevInts = (int*)kDevB;

// Argument storage for a launch through cudaLaunchKernel / ExC / the driver
struct KernelArgs {
    float* fp = kDevFloats;
    int* ip = kDevInts;
    float s = kScaleFactor;
    int n = kElems;
    void* arr[3];
    void** for_kernel(int k) {
        if (k == K_SCALE) {
            arr[0] = &fp; arr[1] = &s; arr[2] = &n;
        } else if (k == K_ADD_N) {
            arr[0] = &ip; arr[1] = &n; arr[2] = nullptr;
        } else {
            arr[0] = &fp; arr[1] = &n; arr[2] = nullptr;
        }
        return arr;
    }
};

static void log_launch(const char* fn, int64_t t, int ret, const LaunchSpec& L, const dim3& g,
                       const char* via) {
    Line l(fn, t, ret);
    l.str("kernel", kKernelNames[L.kernel]).hex("func", kernel_func(L.kernel))
        .dims("grid", g.x, g.y, g.z).dims("block", L.block[0], L.block[1], L.block[2])
        .num("shmem", L.shmem).hex("stream", L.stream);
    if (via) l.str("via", via);
    l.emit();
}

static void launch_chevron(const LaunchSpec& L, unsigned grid_x_add) {
    dim3 g(L.grid[0] + grid_x_add, L.grid[1], L.grid[2]);
    dim3 b(L.block[0], L.block[1], L.block[2]);
    cudaStream_t st = (cudaStream_t)L.stream;
    int64_t t = now_ns();
    switch (L.kernel) {
        case K_SCALE: pi_test::scale<float><<<g, b, L.shmem, st>>>(kDevFloats, kScaleFactor, kElems); break;
        case K_ADD_N: pi_test::inner::add_n<4><<<g, b, L.shmem, st>>>(kDevInts, kElems); break;
        default: plain_fill<<<g, b, L.shmem, st>>>(kDevFloats, kElems); break;
    }
    int ret = (int)cudaGetLastError();
    log_launch("cudaLaunchKernel", t, ret, L, g, "<<<>>>");
}

static void launch_kernel(const Runtime& rt, const LaunchSpec& L, unsigned grid_x_add) {
    dim3 g(L.grid[0] + grid_x_add, L.grid[1], L.grid[2]);
    dim3 b(L.block[0], L.block[1], L.block[2]);
    KernelArgs a;
    void** args = a.for_kernel(L.kernel);
    int64_t t = now_ns();
    int ret = rt.cudaLaunchKernel(kernel_func(L.kernel), g, b, args, L.shmem, (cudaStream_t)L.stream);
    log_launch("cudaLaunchKernel", t, ret, L, g, nullptr);
}

static void launch_kernel_exc(const Runtime& rt, const LaunchSpec& L, unsigned grid_x_add) {
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = dim3(L.grid[0] + grid_x_add, L.grid[1], L.grid[2]);
    cfg.blockDim = dim3(L.block[0], L.block[1], L.block[2]);
    cfg.dynamicSmemBytes = L.shmem;
    cfg.stream = (cudaStream_t)L.stream;
    cfg.attrs = nullptr;
    cfg.numAttrs = 0;
    KernelArgs a;
    void** args = a.for_kernel(L.kernel);
    int64_t t = now_ns();
    int ret = rt.cudaLaunchKernelExC(&cfg, kernel_func(L.kernel), args);
    log_launch("cudaLaunchKernelExC", t, ret, L, cfg.gridDim, nullptr);
}

static void driver_calls(const Driver& d) {
    int64_t t = now_ns();
    int ret = d.cuInit(0);
    Line("cuInit", t, ret).num("flags", 0).emit();

    CUfunction f = (CUfunction)kDriverFuncSentinel;
    t = now_ns();
    ret = d.cuModuleGetFunction(&f, (CUmodule)kModule, kDriverFuncName);
    Line("cuModuleGetFunction", t, ret).hex("module", kModule).str("name", kDriverFuncName)
        .hex("func", (const void*)f).emit();

    KernelArgs a;
    void** args = a.for_kernel(K_SCALE);
    for (int i = 0; i < kDriverLaunches; i++) {
        const DriverLaunchSpec& L = kDriverLaunchSpecs[i];
        t = now_ns();
        ret = d.cuLaunchKernel(f, L.grid[0], L.grid[1], L.grid[2], L.block[0], L.block[1],
                               L.block[2], L.shmem, (CUstream)L.stream, args, nullptr);
        Line("cuLaunchKernel", t, ret).str("kernel", kDriverFuncName).hex("func", (const void*)f)
            .dims("grid", L.grid[0], L.grid[1], L.grid[2])
            .dims("block", L.block[0], L.block[1], L.block[2]).num("shmem", L.shmem)
            .hex("stream", L.stream).emit();
    }
    const DriverLaunchSpec& L = kDriverLaunchExSpec;
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = L.grid[0]; cfg.gridDimY = L.grid[1]; cfg.gridDimZ = L.grid[2];
    cfg.blockDimX = L.block[0]; cfg.blockDimY = L.block[1]; cfg.blockDimZ = L.block[2];
    cfg.sharedMemBytes = L.shmem;
    cfg.hStream = (CUstream)L.stream;
    cfg.attrs = nullptr;
    cfg.numAttrs = 0;
    t = now_ns();
    ret = d.cuLaunchKernelEx(&cfg, f, args, nullptr);
    Line("cuLaunchKernelEx", t, ret).str("kernel", kDriverFuncName).hex("func", (const void*)f)
        .dims("grid", L.grid[0], L.grid[1], L.grid[2])
        .dims("block", L.block[0], L.block[1], L.block[2]).num("shmem", L.shmem)
        .hex("stream", L.stream).emit();
}

static void copies(const Runtime& rt, char* h1, char* h2) {
    void* const devA = (void*)kDevA;
    void* const devB = (void*)kDevB;
    // cudaMemcpy of each kind: {dst, src}
    void* dst[5] = {h1, devA, h1, devA, devA};
    const void* src[5] = {h2, h2, devB, devB, h2};
    for (int kind = 0; kind < 5; kind++) {
        int64_t t = now_ns();
        int ret = rt.cudaMemcpy(dst[kind], src[kind], kMemcpyBytes[kind], (cudaMemcpyKind)kind);
        Line("cudaMemcpy", t, ret).num("bytes", kMemcpyBytes[kind]).num("kind", kind)
            .hex("dst", dst[kind]).hex("src", src[kind]).emit();
    }
    for (int i = 0; i < 2; i++) {
        const AsyncCopySpec& c = kMemcpyAsync[i];
        void* d = c.kind == cudaMemcpyHostToDevice ? devA : (void*)h1;
        const void* s = c.kind == cudaMemcpyHostToDevice ? (const void*)h2 : devB;
        int64_t t = now_ns();
        int ret = rt.cudaMemcpyAsync(d, s, c.bytes, (cudaMemcpyKind)c.kind, (cudaStream_t)c.stream);
        Line("cudaMemcpyAsync", t, ret).num("bytes", c.bytes).num("kind", c.kind).hex("dst", d)
            .hex("src", s).hex("stream", c.stream).emit();
    }
    {
        int64_t t = now_ns();
        int ret = rt.cudaMemcpy2D(devA, kCopy2DDpitch, h2, kCopy2DSpitch, kCopy2DWidth,
                                  kCopy2DHeight, cudaMemcpyHostToDevice);
        Line("cudaMemcpy2D", t, ret).num("bytes", kCopy2DWidth * kCopy2DHeight)
            .num("kind", cudaMemcpyHostToDevice).hex("dst", devA).hex("src", h2)
            .num("width", kCopy2DWidth).num("height", kCopy2DHeight)
            .num("dpitch", kCopy2DDpitch).num("spitch", kCopy2DSpitch).emit();
    }
    {
        int64_t t = now_ns();
        int ret = rt.cudaMemcpy2DAsync(h1, kCopy2DAsyncDpitch, devB, kCopy2DAsyncSpitch,
                                       kCopy2DAsyncWidth, kCopy2DAsyncHeight,
                                       cudaMemcpyDeviceToHost, (cudaStream_t)kStreamB);
        Line("cudaMemcpy2DAsync", t, ret).num("bytes", kCopy2DAsyncWidth * kCopy2DAsyncHeight)
            .num("kind", cudaMemcpyDeviceToHost).hex("dst", h1).hex("src", devB)
            .num("width", kCopy2DAsyncWidth).num("height", kCopy2DAsyncHeight)
            .num("dpitch", kCopy2DAsyncDpitch).num("spitch", kCopy2DAsyncSpitch)
            .hex("stream", kStreamB).emit();
    }
    const uintptr_t memset_streams[2] = {kStreamA, kStreamB};
    for (int i = 0; i < 2; i++) {
        int64_t t = now_ns();
        int ret = rt.cudaMemsetAsync(devA, kMemsetValue, kMemsetAsyncBytes[i],
                                     (cudaStream_t)memset_streams[i]);
        Line("cudaMemsetAsync", t, ret).num("bytes", kMemsetAsyncBytes[i]).hex("dst", devA)
            .num("value", kMemsetValue).hex("stream", memset_streams[i]).emit();
    }
    {
        int64_t t = now_ns();
        int ret = rt.cudaMemset(devB, kMemsetValue, kMemsetBytes);
        Line("cudaMemset", t, ret).num("bytes", kMemsetBytes).hex("dst", devB)
            .num("value", kMemsetValue).emit();
    }
}

static void memory(const Runtime& rt) {
    for (int i = 0; i < kMallocs; i++) {
        void* p = (void*)(kMallocSentinelBase + i * kMallocSentinelStep);
        int64_t t = now_ns();
        int ret = rt.cudaMalloc(&p, kMallocSizes[i]);
        Line("cudaMalloc", t, ret).num("size", kMallocSizes[i]).hex("ptr", p).emit();
    }
    for (int i = 0; i < kMallocs - kLeaked; i++) {
        void* p = (void*)(kMallocSentinelBase + i * kMallocSentinelStep);
        int64_t t = now_ns();
        int ret = rt.cudaFree(p);
        Line("cudaFree", t, ret).hex("ptr", p).emit();
    }
    {
        void* p = (void*)kMallocHostSentinel;
        int64_t t = now_ns();
        int ret = rt.cudaMallocHost(&p, kMallocHostBytes);
        Line("cudaMallocHost", t, ret).num("size", kMallocHostBytes).hex("ptr", p).emit();
        t = now_ns();
        ret = rt.cudaFreeHost(p);
        Line("cudaFreeHost", t, ret).hex("ptr", p).emit();
    }
    {
        void* p = (void*)kHostAllocSentinel;
        int64_t t = now_ns();
        int ret = rt.cudaHostAlloc(&p, kHostAllocBytes, kHostAllocFlags);
        Line("cudaHostAlloc", t, ret).num("size", kHostAllocBytes).num("flags", kHostAllocFlags)
            .hex("ptr", p).emit();
    }
    {
        void* p = (void*)kMallocAsyncSentinel;
        int64_t t = now_ns();
        int ret = rt.cudaMallocAsync(&p, kMallocAsyncBytes, (cudaStream_t)kMallocAsyncStream);
        Line("cudaMallocAsync", t, ret).num("size", kMallocAsyncBytes).hex("ptr", p)
            .hex("stream", kMallocAsyncStream).emit();
        t = now_ns();
        ret = rt.cudaFreeAsync(p, (cudaStream_t)kMallocAsyncStream);
        Line("cudaFreeAsync", t, ret).hex("ptr", p).hex("stream", kMallocAsyncStream).emit();
    }
}

// The synchronising calls' count and time, each timed from just before it to just after it
// (printed with --until): what a profiler's time for them cannot exceed.
static long sync_calls = 0;
static int64_t sync_ns = 0;

static int64_t timed_sync(int64_t t) {
    sync_calls++;
    sync_ns += now_ns() - t;
    return t;
}

static void syncs(const Runtime& rt) {
    int64_t t = now_ns();
    int ret = rt.cudaDeviceSynchronize();
    Line("cudaDeviceSynchronize", timed_sync(t), ret).emit();
    t = now_ns();
    ret = rt.cudaStreamSynchronize((cudaStream_t)kStreamA);
    Line("cudaStreamSynchronize", timed_sync(t), ret).hex("stream", kStreamA).emit();
    t = now_ns();
    ret = rt.cudaEventSynchronize((cudaEvent_t)kEvent);
    Line("cudaEventSynchronize", timed_sync(t), ret).hex("event", kEvent).emit();
    t = now_ns();
    ret = rt.cudaStreamWaitEvent((cudaStream_t)kStreamB, (cudaEvent_t)kEvent, 0);
    Line("cudaStreamWaitEvent", timed_sync(t), ret).hex("stream", kStreamB).hex("event", kEvent)
        .num("flags", 0).emit();
}

static void graph(const Runtime& rt) {
    cudaStream_t st = (cudaStream_t)kCaptureStream;
    int64_t t = now_ns();
    int ret = rt.cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
    Line("cudaStreamBeginCapture", t, ret).hex("stream", kCaptureStream)
        .num("mode", cudaStreamCaptureModeGlobal).emit();
    for (int i = 0; i < 2; i++) launch_kernel(rt, kCaptureLaunches[i], 0);
    cudaGraph_t g = (cudaGraph_t)kGraphSentinel;
    t = now_ns();
    ret = rt.cudaStreamEndCapture(st, &g);
    Line("cudaStreamEndCapture", t, ret).hex("stream", kCaptureStream).hex("graph", (const void*)g)
        .emit();
    cudaGraphExec_t exec = (cudaGraphExec_t)kExecSentinel;
    t = now_ns();
    ret = rt.cudaGraphInstantiate(&exec, g, 0);
    Line("cudaGraphInstantiate", t, ret).hex("graph", (const void*)g).hex("exec", (const void*)exec)
        .num("flags", 0).emit();
    for (int i = 0; i < kGraphLaunches; i++) {
        t = now_ns();
        ret = rt.cudaGraphLaunch(exec, st);
        Line("cudaGraphLaunch", t, ret).hex("exec", (const void*)exec).hex("stream", kCaptureStream)
            .emit();
    }
}

static void sequence(const Runtime& rt, bool linked, const Driver* drv, char* h1, char* h2) {
    if (linked)
        for (int i = 0; i < kLaunchesPerMode; i++) launch_chevron(kLaunches[i], kModeGridX[MODE_CHEVRON]);
    for (int i = 0; i < kLaunchesPerMode; i++) launch_kernel(rt, kLaunches[i], kModeGridX[MODE_LAUNCH_KERNEL]);
    for (int i = 0; i < kLaunchesPerMode; i++)
        launch_kernel_exc(rt, kLaunches[i], kModeGridX[MODE_LAUNCH_KERNEL_EXC]);
    if (drv) driver_calls(*drv);
    copies(rt, h1, h2);
    memory(rt);
    syncs(rt);
    graph(rt);
}

static int usage() {
    fprintf(stderr,
            "usage: cuda_calls --log FILE [--runtime linked | --runtime dlopen:PATH] "
            "[--libcuda PATH] [--start-after FILE] [--repeat R | --until FILE] [--libcuda-early]\n");
    return 2;
}

int main(int argc, char** argv) {
    const char* log_path = nullptr;
    const char* runtime = "linked";
    const char* libcuda = nullptr;
    const char* start_after = nullptr;
    const char* until = nullptr;
    int repeat = 1;
    bool libcuda_early = false;
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (!strcmp(a, "--libcuda-early")) {
            libcuda_early = true;
            continue;
        }
        if (i + 1 >= argc) return usage();
        if (!strcmp(a, "--log")) log_path = argv[++i];
        else if (!strcmp(a, "--runtime")) runtime = argv[++i];
        else if (!strcmp(a, "--libcuda")) libcuda = argv[++i];
        else if (!strcmp(a, "--start-after")) start_after = argv[++i];
        else if (!strcmp(a, "--repeat")) repeat = atoi(argv[++i]);
        else if (!strcmp(a, "--until")) until = argv[++i];
        else return usage();
    }
    bool linked = !strcmp(runtime, "linked");
    if (!log_path || repeat < 0 || (!linked && strncmp(runtime, "dlopen:", 7))) return usage();

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

    Driver drv;
    if (libcuda && libcuda_early && !driver_dlopen(&drv, libcuda)) return 3;
    if (start_after) {
        printf("ready %d\n", (int)getpid());
        fflush(stdout);
        while (access(start_after, F_OK) != 0) usleep(10000);
    }

    Runtime rt;
    if (linked) runtime_linked(&rt);
    else if (!runtime_dlopen(&rt, runtime + 7)) return 3;
    if (libcuda && !libcuda_early && !driver_dlopen(&drv, libcuda)) return 3;

    char* h1 = (char*)calloc(1, kHostBufBytes);
    char* h2 = (char*)calloc(1, kHostBufBytes);
    if (until) {
        long made = 0;
        for (; access(until, F_OK) != 0; made++) sequence(rt, linked, libcuda ? &drv : nullptr, h1, h2);
        printf("syncs %ld %lld\n", sync_calls, (long long)sync_ns);
        printf("repeats %ld\n", made);
        fflush(stdout);
    } else {
        for (int r = 0; r < repeat; r++) sequence(rt, linked, libcuda ? &drv : nullptr, h1, h2);
    }
    flush_log();
    free(h1);
    free(h2);
    return 0;
}
