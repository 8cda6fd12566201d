/* This process's pid, cached and kept right across fork().
 *
 * Shared state is changed only by the process that owns it: an end records
 * the pid that created or attached it, and every write into shared memory
 * that can run outside the queue's own calls (a close, a __dealloc__, an
 * exit hook) first compares it with this one.  A forked child inherits the
 * parent's objects; when it exits it must not release the parent's reader
 * slot or arena slots.  getpid() is a syscall on current glibc, so the pid
 * is cached and refreshed by a pthread_atfork child handler, which runs in
 * every child that fork() creates (os.fork, multiprocessing's fork).
 *
 * Static: each extension module that includes this header has its own
 * copy, registered once by fmq_pid_init() at the module's import. */
#ifndef FMQ_PROC_H
#define FMQ_PROC_H

#include <pthread.h>
#include <unistd.h>

static long fmq_pid_cached = 0;

static void fmq_pid_after_fork(void) { fmq_pid_cached = (long)getpid(); }

static inline int fmq_pid_init(void) {
    fmq_pid_cached = (long)getpid();
    return pthread_atfork(NULL, NULL, fmq_pid_after_fork);
}

static inline long fmq_self_pid(void) { return fmq_pid_cached; }

#endif
