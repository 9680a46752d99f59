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

#include "base/log.h"

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

/* Whether a is a loopback address (127.0.0.0/8, ::1, ::ffff:127.0.0.0/104). */
bool llmdd__sockaddr_loopback(const llmdd__sockaddr *a);

/* CLOCK_MONOTONIC in ms: the clock of every deadline. */
int64_t llmdd__now_ms(void);

/*
 * Cancellation of the request whose transfer a thread runs. A request holds
 * no descriptor of its own: a thread that works for a cancellable request
 * enters its cancellation (llmdd__cancel_enter) with the thread's own
 * eventfd (made on the thread's first use, closed when the thread exits),
 * and llmdd__cancel_fire signals the eventfds of every thread inside, so
 * every llmdd__wait_fd on such a thread gives up at once.
 * llmdd__cancelled() tells that cause apart from a lost peer, so a
 * transport discards the connection but keeps the link.
 *
 * A thread may instead block in a socket call itself (a recv that sleeps in
 * the kernel wakes once, where poll and then recv wake twice): it arms the
 * socket first (llmdd__cancel_arm, with a node on its stack), and fire
 * shuts down every armed socket, which fails the blocked call. Arming and
 * firing take the cancellation's lock, so a socket is shut down only while
 * its thread is inside the call, never after it went on to close the fd.
 */
typedef struct llmdd__armed {
    int fd;     /* a socket to shut down, or a thread's eventfd to signal */
    bool waker; /* fd is an eventfd */
    bool cut;   /* fire acted on it */
    struct llmdd__armed *prev, *next;
} llmdd__armed;

typedef struct {
    atomic_bool flag;
    pthread_mutex_t lock;
    llmdd__armed *armed; /* threads inside and sockets armed */
} llmdd__cancel;

void llmdd__cancel_init(llmdd__cancel *c);
void llmdd__cancel_fini(llmdd__cancel *c);
/* Cancels: sets the flag, wakes the threads inside, cuts armed sockets. */
void llmdd__cancel_fire(llmdd__cancel *c);
/*
 * The calling thread works for c (NULL: for nothing cancellable) until
 * llmdd__cancel_leave. With `wake`, its waits wake at fire: it needs its
 * eventfd, and -1 means that could not be made (EMFILE: the caller fails
 * the work, naming the shortage). Without, only llmdd__cancelled() and
 * armed sockets see the cancel (synchronous calls, which nothing cancels
 * but finalize and a lost link, both of which wake them otherwise).
 */
int llmdd__cancel_enter(llmdd__cancel *c, bool wake);
void llmdd__cancel_leave(void);
bool llmdd__cancelled(void);

/*
 * Before this thread blocks in a call on fd: LLMDD__CANCEL_ARMED (disarm
 * after the call), LLMDD__CANCEL_NONE when the thread has no cancellation
 * (the caller blocks anyway or waits with llmdd__wait_fd), or
 * LLMDD__CANCEL_FIRED when the request is cancelled already (the caller
 * gives up).
 */
#define LLMDD__CANCEL_ARMED 0
#define LLMDD__CANCEL_NONE (-1)
#define LLMDD__CANCEL_FIRED (-2)
int llmdd__cancel_arm(llmdd__armed *a, int fd);
/* After the call: whether fire cut fd meanwhile (the connection is gone). */
bool llmdd__cancel_disarm(llmdd__armed *a);

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
 * LLM_TIMEOUT. A connect the peer refused or did not answer (reset,
 * unreachable, timed out, or stop_fd fired) is logged at miss_level: the
 * caller knows whether its caller retries (a link call: info) or the
 * failure is final (error); a local failure (socket, bind, no address or
 * port left) always at error.
 */
int llmdd__connect(int stop_fd, const llmdd__sockaddr *addr,
                   const llmdd__sockaddr *from, int64_t deadline_ms,
                   enum llmdd__log_level miss_level, llmdd_status *status);

/*
 * TCP_NODELAY, TCP_USER_TIMEOUT (user_timeout_ms: how long sent data may
 * stay unacknowledged before the kernel gives up on the connection; 0: the
 * system's) and, on a connection within this host, LLMDD__SAME_HOST_CC.
 */
void llmdd__sock_tune(int fd, uint32_t user_timeout_ms);
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
