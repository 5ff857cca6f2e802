/* A probe that does nothing: put for a few windows inside calls a collector already times,
 * it shows what one trap costs the target there (core/calibration/insitu.py). The kernel counts its runs
 * and run time like any program's, so what it adds is charged too. */
#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/ptrace.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

SEC("uprobe")
int bare_hit(struct pt_regs *ctx)
{
    return 0;
}
