/* The CUDA level's layouts, shared by cuda.bpf.c and its decoder (profinfer/cuda).
 * Layout rules: llamacpp.h's (profinfer/core/ebpf/layout.py parses this file).
 *
 * Every probed function (runtime or driver API) has an index, its attach cookie, and a spec
 * in `api_specs` saying what its arguments are (its class) and where its stream is. */
#pragma once

#include "transport.h"

#define PC_EV_CALL 48         /* one CUDA call (the level's event range is 48-63) */

#define PC_MAX_APIS 128       /* functions probed per object (the cookie is the index) */
#define PC_NAME_LEN 96        /* a registered kernel's name, as read (longer: cut) */
#define PC_RUNTIME_RANGES 4   /* code ranges of CUDA runtimes per process (nested-call check) */

/* What a function's arguments are (x86-64 SysV integer slots: 0-5 registers, 6 on stack). */
/* cudaLaunchKernel(func, dim3 grid, dim3 block, args, shmem, stream): grid x|y<<32 in rsi, z in
 * edx, block likewise in rcx, r8d. The launch configs (cudaLaunchConfig_t, CUlaunchConfig):
 * grid@0, block@12, shmem@24 (read as u32: the driver's is u32), stream@32. */
#define PC_LAUNCH 1           /* cudaLaunchKernel(func, grid, block, args, shmem, stream) */
#define PC_LAUNCH_CONFIG 2    /* cudaLaunchKernelExC(config*, func, args), cuLaunchKernelEx(config*, f, ...) */
#define PC_DRV_LAUNCH 3       /* cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, ...) */
#define PC_GRAPH_LAUNCH 4     /* cudaGraphLaunch / cuGraphLaunch(exec, stream) */
#define PC_CAPTURE_BEGIN 5    /* cudaStreamBeginCapture(stream, mode) */
#define PC_CAPTURE_END 6      /* cudaStreamEndCapture(stream, graph*) */
#define PC_MEMCPY 7           /* (dst, src, count, kind[, stream]) */
#define PC_MEMCPY_2D 8        /* (dst, dpitch, src, spitch, width, height, kind[, stream]) */
#define PC_MEMSET 9           /* (ptr, value, count[, stream]) */
#define PC_MALLOC 10          /* (void **ptr, size, ...): the pointer read at return */
#define PC_FREE 11            /* (ptr[, stream]) */
#define PC_SYNC 12            /* (): device; (stream) or (event): `handle_slot` */
#define PC_STREAM_WAIT 13     /* cudaStreamWaitEvent(stream, event, flags) */
#define PC_GRAPH_INSTANTIATE 14   /* (exec*, graph, ...): the exec read at return */
#define PC_GET_KERNEL 15      /* __cudaGetKernel(cudaKernel_t*, hostFn): the handle at return */
#define PC_MODULE_FUNCTION 16 /* cuModuleGetFunction(CUfunction*, module, name): f at return */
#define PC_REGISTER_FUNCTION 17   /* __cudaRegisterFunction(fatbin, hostFn, deviceFn, deviceName, ...) */

#define PC_NO_SLOT 0xff

struct pc_api_spec {
    u8 cls;                   /* PC_* above */
    u8 stream_slot;           /* where the stream is (PC_NO_SLOT: none, the default stream) */
    u8 handle_slot;           /* PC_SYNC: the stream or event waited on (PC_NO_SLOT: device) */
    u8 memory;                /* PC_MALLOC/PC_FREE: 1 device, 2 pinned host */
    u8 pad[4];
};

/* Flags of a call. */
#define PC_CAPTURED 1         /* a launch made while its stream was being captured into a graph */
#define PC_OP_OPEN 2          /* an engine op was open on the thread (op, op_start_ns) */
#define PC_STEP_OPEN 4        /* an engine step was open on the thread */
/* A followed process's value in the `followed` map (a daemon's): with this bit, its launches
 * are counted by function alone (the governor took its per-call detail away) */
#define PC_FOLLOW_COUNTS_ONLY 2

struct pc_call {
    u32 kind;
    u32 api;                  /* the function's index (the attach cookie) */
    u32 tid;
    u32 tgid;
    u64 start_ns;
    u64 end_ns;               /* 0: probed at entry only (launches) */
    u64 step;                 /* the thread's open span (transport.h) when the call began */
    u64 op_start_ns;
    u32 op;
    u32 engine;
    u64 handle;               /* kernel function or handle, graph exec, event, module */
    u64 stream;
    u64 bytes;                /* copied or set, or asked to allocate */
    u64 ptr;                  /* allocated or freed; copy destination; a handle made at return */
    u64 ptr2;                 /* copy source; the host function of a registration */
    u64 caller;               /* the return address: the call site */
    u32 grid[3];
    u32 block[3];
    u32 shmem;
    u32 copy_kind;            /* cudaMemcpyKind: H2H 0, H2D 1, D2H 2, D2D 3, Default 4 */
    s32 ret;                  /* the result (cudaError_t / CUresult); 0 when not read */
    u32 flags;                /* PC_CAPTURED, PC_OP_OPEN, PC_STEP_OPEN */
    char name[PC_NAME_LEN];   /* registrations only (other records end before it) */
};

/* Without a timeline, launches, copies, sets and syncs are counted in BPF per this key. */
struct pc_agg_key {
    u32 tgid;
    u32 api;
    u64 handle;
    u64 stream;
    u32 grid[3];
    u32 block[3];
    u32 shmem;
    u32 copy_kind;
    u32 op;
    u32 engine;
    u32 flags;
    s32 ret;
};

struct pc_agg_value {
    u64 calls;
    u64 total_ns;             /* host time in the calls (those probed at return) */
    u64 bytes;
    u64 max_ns;
};

/* A process's CUDA runtime code ([start, end) per copy): a driver call made from there is
 * the runtime's own (cudaLaunchKernel calling cuLaunchKernel), not counted again. */
struct pc_runtime_ranges {
    u64 start[PC_RUNTIME_RANGES];
    u64 end[PC_RUNTIME_RANGES];
};

/* The CUDA object's configuration (its .rodata). */
struct pi_config {
    struct pi_transport transport;
    u32 timeline;             /* 1: every call is sent; 0: counted in `agg` where it can be */
    u32 pad;
};
