/* Uprobes of the toy engine: toy_decode(seq, pos0, n_tokens) and toy_op(op, n_tokens), each
 * timed from entry to return and sent at its return. */
#define PI_ENGINE_EVENTS "toyengine.h"
#include "common.bpf.h"

char LICENSE[] SEC("license") = "GPL";

/* Per thread: its open decode call and its open op (the toy's ops do not nest). */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 1024);
    __type(key, u32);
    __type(value, struct toy_event);
} open_decode SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 1024);
    __type(key, u32);
    __type(value, struct toy_event);
} open_op SEC(".maps");

static __always_inline void begin(void *open, u32 kind, struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct toy_event ev = {.kind = kind, .tid = tid, .tgid = id >> 32,
                           .cpu = bpf_get_smp_processor_id()};
    if (kind == TOY_EV_DECODE) {
        ev.seq = PT_REGS_PARM1(ctx);
        ev.pos0 = PT_REGS_PARM2(ctx);
        ev.n_tokens = PT_REGS_PARM3(ctx);
    } else {
        ev.op = PT_REGS_PARM1(ctx);
        ev.n_tokens = PT_REGS_PARM2(ctx);
    }
    ev.start_ns = bpf_ktime_get_ns();
    bpf_map_update_elem(open, &tid, &ev, BPF_ANY);
}

static __always_inline void end(void *open, struct pt_regs *ctx)
{
    u64 now = bpf_ktime_get_ns();
    u32 tid = current_tid();
    struct toy_event *ev = bpf_map_lookup_elem(open, &tid);
    if (!ev)
        return;
    ev->end_ns = now;
    ev->ret = PT_REGS_RC(ctx);
    if (emit(ctx, ev, sizeof(*ev)))
        count_lost(1);
    bpf_map_delete_elem(open, &tid);
}

SEC("uprobe")
int toy_decode_enter(struct pt_regs *ctx)
{
    if (in_target())
        begin(&open_decode, TOY_EV_DECODE, ctx);
    return 0;
}

SEC("uretprobe")
int toy_decode_return(struct pt_regs *ctx)
{
    end(&open_decode, ctx);
    return 0;
}

SEC("uprobe")
int toy_op_enter(struct pt_regs *ctx)
{
    if (in_target())
        begin(&open_op, TOY_EV_OP, ctx);
    return 0;
}

SEC("uretprobe")
int toy_op_return(struct pt_regs *ctx)
{
    end(&open_op, ctx);
    return 0;
}
