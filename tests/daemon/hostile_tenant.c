/* A hostile tenant, run in its own mount namespace and root: it unmounts the host's old
 * root, maps argv[1] (a file named
 * like an engine's library) executable, turns its loader's path into a FIFO, says so in
 * /ready, then waits. With "fifo PATH": it maps PATH executable too, then deletes it and
 * makes a FIFO at its path (what /proc/PID/maps names). With "also PATH...": it maps each PATH executable too. With "copies N":
 * N-1 children of it wait alike (they map what it mapped). With "swap HOSTDIR": once a reader has read the library (IN_ACCESS,
 * then IN_CLOSE_NOWRITE) it swaps the library's directory for an absolute symlink to
 * HOSTDIR (a host directory: to a reader that resolves the path outside this root) and
 * says so in /swapped. With "maps N": it maps one page of a file under a ~3.6 KB path N times
 * (no two merge: each maps the file's offset 0), readable and executable by turns, then
 * maps and unmaps another page every 0.2 s (its size changes: a scan looks at it again). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>
#include <libgen.h>

static void mark(const char *path) { FILE *f = fopen(path, "w"); if (f) fclose(f); }

int main(int argc, char **argv) {
    if (umount2("/.host", MNT_DETACH) || rmdir("/.host")) return 1;   /* no way back to the host */
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0 || mmap(0, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0) == MAP_FAILED) return 1;
    close(fd);
    rename("/lib64/ld-linux-x86-64.so.2", "/lib64/ld.real");
    mkfifo("/lib64/ld-linux-x86-64.so.2", 0600);
    if (argc > 3 && !strcmp(argv[2], "fifo")) {
        int k = open(argv[3], O_RDONLY);
        if (k < 0 || mmap(0, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, k, 0) == MAP_FAILED) return 1;
        close(k);
        if (unlink(argv[3]) || mkfifo(argv[3], 0600)) return 1;
    }
    if (argc > 3 && !strcmp(argv[2], "copies"))       /* N processes alike, in this root */
        for (long i = 1; i < atol(argv[3]); i++)
            if (fork() == 0) { pause(); return 0; }
    if (argc > 3 && !strcmp(argv[2], "also"))        /* other files, mapped executable too */
        for (int i = 3; i < argc; i++) {
            int k = open(argv[i], O_RDONLY);
            if (k < 0 || mmap(0, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, k, 0) == MAP_FAILED) return 1;
            close(k);
        }
    if (argc > 3 && !strcmp(argv[2], "maps")) {
        char deep[4096] = "";
        for (int i = 0; i < 18; i++) {          /* 18 components of 199 characters */
            strcat(deep, "/");
            memset(deep + strlen(deep), 'd', 199);
            deep[i * 200 + 200] = 0;
            mkdir(deep, 0755);
        }
        strcat(deep, "/page");
        int k = open(deep, O_RDWR | O_CREAT, 0644);
        if (k < 0 || ftruncate(k, 4096)) return 1;
        long n = atol(argv[3]);
        for (long i = 0; i < n; i++)
            if (mmap(0, 4096, i % 2 ? PROT_READ : PROT_READ | PROT_EXEC, MAP_PRIVATE, k, 0) == MAP_FAILED) return 1;
        mark("/ready");
        for (;;) {
            void *p = mmap(0, 4096, PROT_READ, MAP_PRIVATE, k, 0);
            usleep(100000);
            munmap(p, 4096);
            usleep(100000);
        }
    }
    int in = -1;
    if (argc > 3 && !strcmp(argv[2], "swap")) {
        in = inotify_init();
        inotify_add_watch(in, argv[1], IN_ACCESS | IN_CLOSE_NOWRITE);
    }
    mark("/ready");
    if (in < 0) { pause(); return 0; }
    char buf[4096] __attribute__((aligned(8)));
    int accessed = 0;
    for (;;) {
        ssize_t n = read(in, buf, sizeof buf);
        if (n <= 0) return 1;
        for (char *p = buf; p < buf + n;) {
            struct inotify_event *e = (struct inotify_event *)p;
            if (e->mask & IN_ACCESS) accessed = 1;
            else if ((e->mask & IN_CLOSE_NOWRITE) && accessed) goto swap;
            p += sizeof *e + e->len;
        }
    }
swap:;
    char dir[4096];
    strncpy(dir, argv[1], sizeof dir - 1);
    char *d = dirname(dir), moved[4200];
    snprintf(moved, sizeof moved, "%s.real", d);
    rename(d, moved);
    symlink(argv[3], d);
    mark("/swapped");
    pause();
    return 0;
}
