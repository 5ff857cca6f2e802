/* Node-wide discovery for the daemon: every process that comes to map an engine's (or a
 * level's) library is held before the engine's first call, however briefly it lives, while
 * unrelated processes cost a map lookup at exec and a short look at each library list their
 * loader completes.
 *
 * glibc's loader calls _dl_debug_state (the debuggers' hook) after each change of its library
 * list, before relocating the new libraries or running their constructors: at process start
 * and at each dlopen. Hooked in each loader file user space has seen, the program reads the
 * loader's r_debug; once the list is complete (RT_CONSISTENT) it looks at the entries added
 * since its last look, and a process with one named like a pack's library (`name_prefixes`,
 * written by user space from the packs) is stopped (SIGSTOP) and told about: user space
 * attaches what it maps and lets it go. An executable that defines an engine's marker (linked
 * in statically; `executables`, user space's verdict per file) is held at exec, until its
 * loader's list is complete; an executable not seen before is told about, once, not stopped.
 *
 * Needs kernel BTF (CO-RE reads at exec) and bpf_loop (Linux 5.17); the daemon scans /proc
 * where they are missing. */
#include "common.bpf.h"
#include "recorded.bpf.h"
#include "held.bpf.h"
#include <bpf/bpf_core_read.h>

char LICENSE[] SEC("license") = "GPL";

#define PI_NAME_PREFIXES 16
#define PI_NAME_MAX 32

struct super_block {
    u32 s_dev;
} __attribute__((preserve_access_index));

struct inode {
    unsigned long i_ino;
    struct super_block *i_sb;
} __attribute__((preserve_access_index));

struct file {
    struct inode *f_inode;
} __attribute__((preserve_access_index));

struct linux_binprm {
    struct file *file;
} __attribute__((preserve_access_index));

struct signal_struct {
    void *tty;
} __attribute__((preserve_access_index));

struct task_struct {
    unsigned int ptrace;
    struct signal_struct *signal;
    struct task_struct *group_leader;
    u64 start_boottime;
} __attribute__((preserve_access_index));

/* A name prefix as 8-byte words and the mask of its bytes: compared without a loop per byte. */
struct pi_name_prefix {
    u64 word[PI_NAME_MAX / 8];
    u64 mask[PI_NAME_MAX / 8];
};

/* The packs' library names up to their first wildcard ("libllama.so", "_C", "libcudart.so"). */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, PI_NAME_PREFIXES);
    __type(key, u32);
    __type(value, struct pi_name_prefix);
} name_prefixes SEC(".maps");

/* Executable files told about: PI_EXEC_ENGINE defines an engine's marker, PI_EXEC_NONE does
 * not, PI_EXEC_UNKNOWN not known (told, not looked at, or gone before it could be). */
struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 8192);
    __type(key, struct pi_file_key);
    __type(value, u32);
} executables SEC(".maps");

/* Processes held until user space has attached what they map (tgid -> when, ns). */
struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, PI_MAX_FOLLOWED);
    __type(key, u32);
    __type(value, u64);
} candidates SEC(".maps");

/* This daemon (written by user space before anything is attached). */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, struct pi_process_id);
} holder SEC(".maps");

/* Each probed site of a loader's hook (a `call _dl_debug_state`; its attach cookie indexes
 * this): the site's vaddr (so the loader's load address is ip - site) and _r_debug's. */
struct pi_hook_site {
    u64 site;
    u64 r_debug;
};

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, PI_MAX_HOOK_SITES);
    __type(key, u32);
    __type(value, struct pi_hook_site);
} hook_sites SEC(".maps");

/* Per process, the last link_map entry looked at: a dlopen appends to the list. */
struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 65536);
    __type(key, u32);
    __type(value, u64);
} looked_at SEC(".maps");

/* struct r_debug { int r_version; struct link_map *r_map; ElfW(Addr) r_brk; int r_state; ... }
 * struct link_map { ElfW(Addr) l_addr; char *l_name; ElfW(Dyn) *l_ld; link_map *l_next, *l_prev; }
 * (glibc's public ABI, <link.h>) */
#define R_MAP 8
#define R_STATE 24
#define RT_CONSISTENT 0
#define RT_DELETE 2
#define L_NAME 8
#define L_NEXT 24
#define PATH_MAX_READ 512
#define PI_MAX_ENTRIES 512      /* link_map entries looked at per hook call */

struct walk {
    u32 owner;          /* the process walking (a preempted walk's buffer is not another's) */
    u32 pad;
    u64 entry;          /* the next link_map entry to look at, 0 at the list's end */
    u64 last;           /* the last one looked at */
    int found;
    char path[PATH_MAX_READ + PI_NAME_MAX];     /* room to read a name's words past the end */
};

struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 1);
    __type(key, u32);
    __type(value, struct walk);
} walk_buf SEC(".maps");

/* Tell user space; 0 when the record is in the buffer. */
static __always_inline long tell(void *ctx, u32 tgid, u32 what, struct pi_file_key *file)
{
    struct pi_discover_event ev = {.kind = PI_EV_DISCOVER, .tgid = tgid, .what = what,
                                   .ts_ns = bpf_ktime_get_ns()};
    if (file)
        ev.file = *file;
    return emit_urgent(ctx, &ev, sizeof(ev));
}

/* Whether a `record` follows the process (recorded.bpf.h): the same one, not a later process
 * given its PID, as its start time says. */
static __always_inline int recorded_now(struct task_struct *task, u32 tgid)
{
    u64 *start = bpf_map_lookup_elem(&recorded, &tgid);
    return start && *start == BPF_CORE_READ(task, group_leader, start_boottime) / PI_NS_PER_TICK;
}

/* Whether stopping the current process would be seen by anyone but user space here: a
 * debugger's (traced), a shell's job control (a controlling terminal), the daemon itself, a
 * `record` (its follower stops the process too, and SIGCONTs are not counted: ours would let
 * it run while the record attaches). */
static __always_inline int may_stop(u32 tgid)
{
    struct task_struct *task = (struct task_struct *)bpf_get_current_task();
    return tgid != cfg.target_tgid && BPF_CORE_READ(task, ptrace) == 0
        && BPF_CORE_READ(task, signal, tty) == 0 && !recorded_now(task, tgid);
}

/* Stop the current process for user space, or only tell where it may not be stopped
 * (PI_DISCOVER_SEEN). 0 when user space was told. */
static __always_inline long hold_and_tell(void *ctx, u32 tgid, u32 what)
{
    if (!may_stop(tgid))
        return tell(ctx, tgid, PI_DISCOVER_SEEN, 0);
    /* entered before the stop (user space, which deletes it as it continues the process,
     * always comes after); not stopped where it cannot be entered */
    u32 zero = 0;
    struct pi_process_id *me = bpf_map_lookup_elem(&holder, &zero);
    if (!me || !me->tgid)       /* no holder written: the hand-off is not shared, hold nothing */
        return tell(ctx, tgid, PI_DISCOVER_SEEN, 0);
    struct task_struct *task = (struct task_struct *)bpf_get_current_task();
    struct pi_held h = {.since_ns = bpf_ktime_get_ns(), .holder = *me};
    h.process.tgid = tgid;
    h.process.start_ticks = BPF_CORE_READ(task, group_leader, start_boottime) / PI_NS_PER_TICK;
    if (bpf_map_update_elem(&held, &tgid, &h, BPF_ANY))
        return tell(ctx, tgid, PI_DISCOVER_SEEN, 0);
    long err = PI_STOP_AND_TELL(tell(ctx, tgid, what, 0));
    if (err)
        bpf_map_delete_elem(&held, &tgid);
    return err;
}

/* Make the current process a candidate; stopped and told when it was not one already. */
static __always_inline void hold(void *ctx, u32 tgid, u32 what)
{
    u64 now = bpf_ktime_get_ns();
    if (bpf_map_update_elem(&candidates, &tgid, &now, BPF_NOEXIST) == 0
        && hold_and_tell(ctx, tgid, what))
        bpf_map_delete_elem(&candidates, &tgid);      /* untold: nothing waits on it */
}

/* sched_process_exec(task, old_pid, bprm): `current` runs its new image. */
SEC("raw_tp/sched_process_exec")
int discover_exec(struct bpf_raw_tracepoint_args *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct linux_binprm *bprm = (struct linux_binprm *)ctx->args[2];
    struct inode *inode = BPF_CORE_READ(bprm, file, f_inode);
    struct pi_file_key key = {.ino = BPF_CORE_READ(inode, i_ino), .dev = BPF_CORE_READ(inode, i_sb, s_dev)};
    bpf_map_delete_elem(&candidates, &tgid);     /* a new image: what it was holds no more */
    bpf_map_delete_elem(&looked_at, &tgid);
    u32 *verdict = bpf_map_lookup_elem(&executables, &key);
    u32 unknown = PI_EXEC_UNKNOWN;
    if (!verdict) {         /* told once per file (a flood of new files fills no ring twice) */
        if (bpf_map_update_elem(&executables, &key, &unknown, BPF_NOEXIST) == 0)
            tell(ctx, tgid, PI_DISCOVER_EXEC, &key);
    } else if (*verdict == PI_EXEC_ENGINE) {
        hold(ctx, tgid, PI_DISCOVER_CANDIDATE);
    }
    return 0;
}

/* Whether a file name (its first PI_NAME_MAX bytes as words) begins like a pack's library. */
static __always_inline int name_matches(const u64 *name)
{
    for (u32 i = 0; i < PI_NAME_PREFIXES; i++) {
        u32 k = i;
        struct pi_name_prefix *p = bpf_map_lookup_elem(&name_prefixes, &k);
        if (!p || !p->mask[0])
            return 0;
        if (((name[0] ^ p->word[0]) & p->mask[0]) == 0 && ((name[1] ^ p->word[1]) & p->mask[1]) == 0
            && ((name[2] ^ p->word[2]) & p->mask[2]) == 0 && ((name[3] ^ p->word[3]) & p->mask[3]) == 0)
            return 1;
    }
    return 0;
}

static long look_at_entry(u64 i, void *unused)
{
    u32 zero = 0;
    struct walk *w = bpf_map_lookup_elem(&walk_buf, &zero);
    if (!w || !w->entry || w->owner != bpf_get_current_pid_tgid() >> 32)
        return 1;
    u64 name = 0, next = 0;
    bpf_probe_read_user(&name, sizeof(name), (void *)(w->entry + L_NAME));
    bpf_probe_read_user(&next, sizeof(next), (void *)(w->entry + L_NEXT));
    w->last = w->entry;
    w->entry = next;
    long n = name ? bpf_probe_read_user_str(w->path, sizeof(w->path), (void *)name) : 0;
    if (n <= 1)
        return 0;
    u32 base = 0;
    for (u32 k = 2; k < PATH_MAX_READ; k++) {       /* the last '/' */
        if (k > n)
            break;
        if (w->path[(n - k) & (PATH_MAX_READ - 1)] == '/') {
            base = n - k + 1;
            break;
        }
    }
    u64 name_words[PI_NAME_MAX / 8] = {};
    bpf_probe_read_kernel(name_words, sizeof(name_words), &w->path[base & (PATH_MAX_READ - 1)]);
    if (name_matches(name_words)) {
        w->found = 1;
        return 1;
    }
    return 0;
}

/* Each call of _dl_debug_state() in the loader files user space has hooked, for all processes. */
SEC("uprobe")
int discover_loader(struct pt_regs *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 idx = bpf_get_attach_cookie(ctx);
    struct pi_hook_site *site = bpf_map_lookup_elem(&hook_sites, &idx);
    if (!site || !site->r_debug)
        return 0;
    u64 r_debug = PT_REGS_IP(ctx) - site->site + site->r_debug;
    int state = -1;
    bpf_probe_read_user(&state, sizeof(state), (void *)(r_debug + R_STATE));
    if (state == RT_DELETE)         /* entries may be freed: look from the list's head next */
        bpf_map_delete_elem(&looked_at, &tgid);
    if (state != RT_CONSISTENT)
        return 0;
    if (bpf_map_lookup_elem(&candidates, &tgid)) {       /* an engine's executable */
        if (hold_and_tell(ctx, tgid, PI_DISCOVER_LOADED))
            bpf_map_delete_elem(&candidates, &tgid);
        return 0;
    }
    u32 zero = 0;
    struct walk *w = bpf_map_lookup_elem(&walk_buf, &zero);
    if (!w)
        return 0;
    u64 *last = bpf_map_lookup_elem(&looked_at, &tgid);
    w->entry = 0;
    if (last)
        bpf_probe_read_user(&w->entry, sizeof(w->entry), (void *)(*last + L_NEXT));
    else
        bpf_probe_read_user(&w->entry, sizeof(w->entry), (void *)(r_debug + R_MAP));
    w->last = last ? *last : 0;
    w->found = 0;
    w->owner = tgid;
    bpf_loop(PI_MAX_ENTRIES, look_at_entry, 0, 0);
    if (w->owner != tgid)           /* another process's walk took the buffer meanwhile */
        return 0;
    if (w->last)
        bpf_map_update_elem(&looked_at, &tgid, &w->last, BPF_ANY);
    if (w->found) {
        u64 now = bpf_ktime_get_ns();
        bpf_map_update_elem(&candidates, &tgid, &now, BPF_ANY);
        if (hold_and_tell(ctx, tgid, PI_DISCOVER_LOADED))
            bpf_map_delete_elem(&candidates, &tgid);
    }
    return 0;
}

SEC("raw_tp/sched_process_exit")
int discover_exit(void *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if ((u32)id == tgid) {
        bpf_map_delete_elem(&candidates, &tgid);
        bpf_map_delete_elem(&looked_at, &tgid);
    }
    return 0;
}
