/* A stand-in for the NVIDIA driver's libnvidia-ml.so.1, for tests on machines without a GPU:
 * the NVML C entry points that the daemon reaches through nvidia-ml-py (pynvml), answering
 * from a text file that the test writes (and may rewrite while the daemon runs).
 *
 *   gcc -shared -fPIC -o DIR/libnvidia-ml.so.1 fake_nvml.c
 *   FAKE_NVML_CONFIG=answers.txt LD_LIBRARY_PATH=DIR <the daemon>
 *
 * The file: one "key value" a line, read again at each call (replace it atomically).
 *   count N                 devices
 *   driver VERSION          nvmlSystemGetDriverVersion
 *   I.name / I.uuid TEXT    device I's name and UUID
 *   I.util / I.memutil N    nvmlDeviceGetUtilizationRates: gpu and memory, percent
 *   I.total / I.reserved / I.used BYTES   nvmlDeviceGetMemoryInfo_v2 (used: without the
 *                           reserved, as drivers since R510 count it; free: the rest); the v1
 *                           query answers used + reserved, as the real library does
 *   I.power MILLIWATTS      nvmlDeviceGetPowerUsage
 *   I.procs PID:BYTES,...   nvmlDeviceGetComputeRunningProcesses_v3 (BYTES "na": not available)
 *   I.lost 1                every call about device I (its handle too) fails: GPU is lost
 *   err.FUNCTION CODE       FUNCTION fails with that nvmlReturn_t (for every device)
 *   err.FUNCTION.I CODE     FUNCTION fails for device I only
 *   block.FUNCTION 1        FUNCTION does not return while the key is there (a driver waiting
 *                           on a GPU that stopped responding)
 * A key that is absent reads as 0 (or "" for text). Calls before nvmlInit* (or after the
 * last nvmlShutdown) fail with NVML_ERROR_UNINITIALIZED, as the real library's do.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_INSUFFICIENT_SIZE = 7, NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25, NVML_ERROR_UNKNOWN = 999,
};
#define MAX_DEVICES 16
#define MAX_PROCS 64

typedef struct { int index; } fake_device;
typedef fake_device *nvmlDevice_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
#define nvmlMemory_v2 (unsigned int)(sizeof(nvmlMemory_v2_t) | (2 << 24U))
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

static fake_device devices[MAX_DEVICES];
static int initialized;

/* the value of key in the answers file, copied into out ("" when absent) */
static int lookup(const char *key, char *out, size_t n) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f = path ? fopen(path, "r") : NULL;
    char line[4096];
    size_t klen = strlen(key);
    int found = 0;
    out[0] = 0;
    if (!f)
        return 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (strncmp(line, key, klen) == 0 && line[klen] == ' ') {
            snprintf(out, n, "%s", line + klen + 1);
            found = 1;
            break;
        }
    }
    fclose(f);
    return found;
}

static unsigned long long number(const char *key) {
    char v[256];
    lookup(key, v, sizeof v);
    return strtoull(v, NULL, 0);
}

static unsigned long long device_number(int i, const char *what) {
    char key[128];
    snprintf(key, sizeof key, "%d.%s", i, what);
    return number(key);
}

/* what fn answers for device i (-1: no device) before looking at its values */
static nvmlReturn_t check(const char *fn, int i) {
    char key[160];
    unsigned long long code;
    if (!initialized)
        return NVML_ERROR_UNINITIALIZED;
    snprintf(key, sizeof key, "block.%s", fn);
    while (number(key))
        usleep(50000);
    if (i >= 0 && device_number(i, "lost"))
        return NVML_ERROR_GPU_IS_LOST;
    snprintf(key, sizeof key, "err.%s", fn);
    if ((code = number(key)))
        return (nvmlReturn_t)code;
    if (i >= 0) {
        snprintf(key, sizeof key, "err.%s.%d", fn, i);
        if ((code = number(key)))
            return (nvmlReturn_t)code;
    }
    return NVML_SUCCESS;
}

static int index_of(nvmlDevice_t d) {
    if (d < devices || d >= devices + MAX_DEVICES)
        return -1;
    return (int)(d - devices);
}

static nvmlReturn_t init(const char *fn) {
    char key[64];
    unsigned long long code;
    snprintf(key, sizeof key, "err.%s", fn);
    if ((code = number(key)))
        return (nvmlReturn_t)code;
    initialized++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return init("nvmlInit_v2"); }
nvmlReturn_t nvmlInit(void) { return init("nvmlInit"); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return init("nvmlInitWithFlags"); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialized)
        return NVML_ERROR_UNINITIALIZED;
    initialized--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t r = check("nvmlSystemGetDriverVersion", -1);
    char v[256];
    if (r)
        return r;
    lookup("driver", v, sizeof v);
    if (strlen(v) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(version, v);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    nvmlReturn_t r = check("nvmlDeviceGetCount_v2", -1);
    if (r)
        return r;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)number("count");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t r;
    if (!device || index >= number("count") || index >= MAX_DEVICES)
        return initialized ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
    if ((r = check("nvmlDeviceGetHandleByIndex_v2", (int)index)))
        return r;
    devices[index].index = (int)index;
    *device = &devices[index];
    return NVML_SUCCESS;
}

static nvmlReturn_t text(const char *fn, nvmlDevice_t d, const char *what, char *buf,
                         unsigned int length) {
    int i = index_of(d);
    char key[64], v[256];
    nvmlReturn_t r;
    if (i < 0 || !buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((r = check(fn, i)))
        return r;
    snprintf(key, sizeof key, "%d.%s", i, what);
    lookup(key, v, sizeof v);
    if (strlen(v) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, v);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    return text("nvmlDeviceGetName", d, "name", name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    return text("nvmlDeviceGetUUID", d, "uuid", uuid, length);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    int i = index_of(d);
    nvmlReturn_t r;
    if (i < 0 || !u)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((r = check("nvmlDeviceGetUtilizationRates", i)))
        return r;
    u->gpu = (unsigned int)device_number(i, "util");
    u->memory = (unsigned int)device_number(i, "memutil");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    int i = index_of(d);
    nvmlReturn_t r;
    if (i < 0 || !m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((r = check("nvmlDeviceGetMemoryInfo", i)))
        return r;
    m->total = device_number(i, "total");
    m->used = device_number(i, "used") + device_number(i, "reserved");
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    int i = index_of(d);
    nvmlReturn_t r;
    if (i < 0 || !m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((r = check("nvmlDeviceGetMemoryInfo_v2", i)))
        return r;
    if (m->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    m->total = device_number(i, "total");
    m->reserved = device_number(i, "reserved");
    m->used = device_number(i, "used");
    m->free = m->total - m->reserved - m->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw) {
    int i = index_of(d);
    nvmlReturn_t r;
    if (i < 0 || !mw)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((r = check("nvmlDeviceGetPowerUsage", i)))
        return r;
    *mw = (unsigned int)device_number(i, "power");
    return NVML_SUCCESS;
}

/* The real library's contract: with too small an array (or none), the count needed and
 * NVML_ERROR_INSUFFICIENT_SIZE; with no processes, 0 and success. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    int i = index_of(d);
    char key[64], v[4096], *s, *save = NULL;
    nvmlProcessInfo_t found[MAX_PROCS];
    unsigned int n = 0;
    nvmlReturn_t r;
    if (i < 0 || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((r = check("nvmlDeviceGetComputeRunningProcesses_v3", i)))
        return r;
    snprintf(key, sizeof key, "%d.procs", i);
    lookup(key, v, sizeof v);
    for (s = strtok_r(v, ",", &save); s && n < MAX_PROCS; s = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(s, ':');
        if (!colon)
            continue;
        *colon = 0;
        found[n].pid = (unsigned int)strtoul(s, NULL, 0);
        found[n].usedGpuMemory = strcmp(colon + 1, "na") == 0 ? ~0ULL : strtoull(colon + 1, NULL, 0);
        found[n].gpuInstanceId = found[n].computeInstanceId = ~0U;
        n++;
    }
    if (*count < n || (n && !infos)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = n;
    if (n)
        memcpy(infos, found, n * sizeof *found);
    return NVML_SUCCESS;
}
