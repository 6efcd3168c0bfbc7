/* LD_PRELOAD this library to print a native backtrace to stderr when the process gets SIGSEGV, SIGBUS or
 * SIGABRT, then die of the signal as before (gpu_check.py's aoti section: where a package load crashes,
 * on machines without gdb). Build: cc -shared -fPIC -O1 -o segv_backtrace.so segv_backtrace.c */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <execinfo.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

static void say(const char *text) { (void)!write(2, text, strlen(text)); }

static void say_hex(uintptr_t value) {
    char digits[2 + 2 * sizeof value + 1] = "0x";
    for (int i = 0; i < (int)(2 * sizeof value); i++)
        digits[2 + i] = "0123456789abcdef"[(value >> (4 * (2 * sizeof value - 1 - i))) & 0xf];
    digits[sizeof digits - 1] = '\0';
    say(digits);
}

static void on_fault(int sig, siginfo_t *info, void *context) {
    (void)context;
    void *frames[64];
    int count = backtrace(frames, 64);
    say("\nnative backtrace (segv_backtrace.c): signal ");
    say(sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : "SIGABRT");
    say(" at address ");
    say_hex((uintptr_t)info->si_addr);
    say("\n");
    backtrace_symbols_fd(frames, count, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    void *warm[1];
    backtrace(warm, 1); /* loads libgcc_s now, not inside the handler */
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO | SA_RESETHAND;
    sigaction(SIGSEGV, &action, NULL);
    sigaction(SIGBUS, &action, NULL);
    sigaction(SIGABRT, &action, NULL);
}
