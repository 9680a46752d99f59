/*
 * Socket helpers below the core, the control plane and the socket
 * transports: the monotonic clock every deadline is measured on, waits that
 * a stop fd and this thread's cancellation interrupt, framed messages with
 * deadlines, connect with a deadline, socket options. They take the fds
 * they need, never an instance. Thread-safe; each function works on the fd
 * it is given.
 */
#ifndef LLMDD_BASE_NET_H
#define LLMDD_BASE_NET_H

#include <llmdd/llmdd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

typedef struct {
    struct sockaddr_storage addr;
    socklen_t len;
} llmdd__sockaddr;

/* Formats an address as "ip:port" or "[ip]:port". */
void llmdd__sockaddr_str(const llmdd__sockaddr *a, char *buf, size_t len);

/* Whether a is a loopback address (127.0.0.0/8, ::1). */
bool llmdd__sockaddr_loopback(const llmdd__sockaddr *a);

/* CLOCK_MONOTONIC in ms: the clock of every deadline. */
int64_t llmdd__now_ms(void);

/*
 * The cancellation of the request whose transfer this thread runs
 * (request.c sets it around ops->xfer). Every llmdd__wait_fd on the thread
 * also wakes when fd becomes readable, so a transport blocked on a socket
 * gives up at once; llmdd__cancelled() tells that cause apart from a lost
 * peer, so the transport discards the connection but keeps the link.
 *
 * A thread may instead block in a socket call itself (a recv that sleeps in
 * the kernel wakes once, where poll and then recv wake twice): it arms the
 * socket first (llmdd__cancel_arm), and llmdd__cancel_fire shuts down every
 * armed socket, which fails the blocked call. Arming and firing take the
 * lock, so a socket is shut down only while its thread is inside the call,
 * never after it went on to close the fd.
 */
/* One request's threads blocked at once: up to 16 tcp lanes, with room. */
#define LLMDD__CANCEL_ARMED_MAX 20
typedef struct {
    int fd; /* eventfd, readable once cancelled */
    atomic_bool flag;
    pthread_mutex_t lock;
    struct {
        int fd;   /* -1: a free slot */
        bool cut; /* fire shut it down */
    } armed[LLMDD__CANCEL_ARMED_MAX];
} llmdd__cancel;
extern _Thread_local llmdd__cancel *llmdd__tls_cancel;
bool llmdd__cancelled(void);

/* 0, or -1 when the eventfd cannot be made. */
int llmdd__cancel_init(llmdd__cancel *c);
void llmdd__cancel_fini(llmdd__cancel *c);
/* Cancels: sets the flag, wakes llmdd__wait_fd, cuts the armed sockets. */
void llmdd__cancel_fire(llmdd__cancel *c);
/*
 * Before this thread blocks in a call on fd: returns a slot for disarm,
 * LLMDD__CANCEL_NONE when the thread has no cancellation or no slot is free
 * (the caller then waits with llmdd__wait_fd), or LLMDD__CANCEL_FIRED when
 * the request is cancelled already (the caller gives up).
 */
#define LLMDD__CANCEL_NONE (-1)
#define LLMDD__CANCEL_FIRED (-2)
int llmdd__cancel_arm(int fd);
/* After the call: whether fire cut fd meanwhile (the connection is gone). */
bool llmdd__cancel_disarm(int slot);

/*
 * Waits until fd is ready for `events`, the deadline passes, stop_fd (the
 * instance's, readable once finalize has begun) becomes readable or this
 * thread's request is cancelled. Returns 1 when ready, 0 on timeout, -1 when
 * stopping, cancelled or on error. A negative stop_fd is ignored (poll skips
 * it).
 */
int llmdd__wait_fd(int stop_fd, int fd, short events, int64_t deadline_ms);
/* Full read/write with a deadline; 0 on success, -1 otherwise. */
int llmdd__read_full(int stop_fd, int fd, void *buf, size_t len,
                     int64_t deadline_ms);
int llmdd__write_full(int stop_fd, int fd, const void *buf, size_t len,
                      int64_t deadline_ms);

/* Sends a frame header and payload in one sendmsg; 0 on success. */
int llmdd__send_msg(int stop_fd, int fd, uint16_t type, const void *payload,
                    size_t len, int64_t deadline_ms);
/*
 * Receives one frame whose payload is at most `cap` bytes into buf.
 * Returns 0 and fills *type and *len, or -1 on a bad header, an oversized
 * payload, EOF, timeout or stop. *timed_out tells a timeout apart.
 */
int llmdd__recv_msg(int stop_fd, int fd, uint16_t *type, uint8_t *buf,
                    size_t cap, size_t *len, int64_t deadline_ms,
                    bool *timed_out);

/*
 * Connects a non-blocking TCP socket to addr by the deadline. Returns the fd,
 * or -1 with *status set: LLM_LINK_FAILED (refused, unreachable) or
 * LLM_TIMEOUT.
 */
int llmdd__connect(int stop_fd, const llmdd__sockaddr *addr,
                   const llmdd__sockaddr *from, int64_t deadline_ms,
                   llmdd_status *status);

/* TCP_NODELAY and, on a connection within this host, LLMDD__SAME_HOST_CC. */
void llmdd__sock_tune(int fd);
/* Keepalive, for control sockets, so a dead host shows. */
void llmdd__sock_keepalive(int fd);

/*
 * The congestion control of a connection that never leaves this host. A
 * pacing one (bbr, a common default) spreads each send over time at its
 * estimate of a bottleneck that loopback does not have: same-host pulls of
 * 64 MiB moved 3.2 GB/s under bbr against 7.8 under cubic, and 128 KiB-1 MiB
 * pulls swung 2x from one minute to the next (BENCHMARKS.md). Between hosts
 * the system's choice stands.
 */
#define LLMDD__SAME_HOST_CC "cubic"

#endif
