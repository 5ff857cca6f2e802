/* Preloaded into llama.cpp's tools by the tests: at exit, wait for llama.cpp's asynchronous
 * logger to write what it holds (its worker thread is joined by common_log_pause).
 *
 * llama.cpp leaks its logger on purpose (upstream issue 22142), so lines still queued when
 * main returns, its own perf summary among them, are lost whenever the worker thread has not
 * run by then, which a loaded CPU makes likely. The tests read that summary as their outside
 * truth; this makes it complete and changes nothing before exit.
 *
 * Registered with atexit from the constructor: it then runs before any library's
 * destructors. A process without llama.cpp's common library (profinfer itself, a compiler)
 * finds no symbol and does nothing. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

static void drain_llama_log(void) {
    void *(*log_main)(void) = (void *(*)(void))dlsym(RTLD_DEFAULT, "_Z15common_log_mainv");
    void (*log_pause)(void *) = (void (*)(void *))dlsym(RTLD_DEFAULT, "_Z16common_log_pauseP10common_log");
    if (log_main && log_pause)
        log_pause(log_main());
}

__attribute__((constructor)) static void register_drain(void) {
    atexit(drain_llama_log);
}
