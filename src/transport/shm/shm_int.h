/*
 * The shm transport's private header: shared by its files (shm.c: link setup
 * and the ops; shm_sock.c: the protocol on the Unix-domain socket; shm_xfer.c:
 * mapping what the peer describes and the transfers), included by nothing
 * else. shm.c's opening comment describes the design and the locking.
 */
#ifndef LLMDD_TRANSPORT_SHM_SHM_INT_H
#define LLMDD_TRANSPORT_SHM_SHM_INT_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "core/copy.h"
#include "core/internal.h"
#include "base/net.h"
#include "base/codec.h"
#include "base/wire.h"
#include "transport/shm/shm.h"
#include "transport/stream/stream.h"

#define SHM_MAGIC 0x4d48534cu /* "LSHM" little-endian */
/* 3: QUERY_REPLY's desc with its batch dimension; 2: the desc without a
 * length prefix. */
#define SHM_VERSION 3
#define SHM_HDR_LEN 16
#define SHM_MSG_MAX 65536
/* A registered cache whose addresses fit in one reply uses CMA. */
#define SHM_CMA_TENSORS_MAX ((SHM_MSG_MAX - SHM_HDR_LEN - 512) / 8)
#define SHM_FLAG_SOCK 0x100u   /* data connection: accept my socket */
#define SHM_FLAG_NOSOCK 0x200u /* data connection: I cannot use it */
#define SHM_ACCEPT_MS 2000
#define SHM_BYE_MS 2000
/* How long one look at the owner's socket vouches for it (owner_left). */
#define SHM_OPEN_MS (SHM_BYE_MS / 4)
#define SHM_STALL_MS 5000
#define SHM_IOV_BATCH 1024              /* iovec pairs per CMA call */
/* One cross-memory attach call at most (well under the kernel's
 * MAX_RW_COUNT); a cancel is seen between calls. */
#define SHM_CMA_BATCH_BYTES (16u << 20)
/* A copy through the mapping goes in pieces of this, a cancel seen between
 * them (a few ms each at memory speed). */
#define SHM_COPY_PIECE (4u << 20)
/* CMA over two threads from here when the instance's assist thread is
 * free; copies through a mapping share their claims with it */
#define SHM_SPLIT_BYTES (4u << 20)
/* The least a shared copy's claim moves (shm_xfer.c). */
#define SHM_CLAIM_MIN (256u << 10)
#define SHM_FWD_CONNS 1                 /* the data plane is a fallback */
#define SHM_DIR "/tmp"    /* shared by every namespace that shares /tmp */
#define SHM_STALE_S 60    /* a socket file this old has lost its link */
#define SHM_REV_CONNS 1

enum {
    SMSG_READY = 1,
    SMSG_QUERY = 2,
    SMSG_QUERY_REPLY = 3,
    SMSG_INVAL = 4,
    SMSG_INVAL_ACK = 5,
};

enum { SHM_KIND_MEMFD = 1, SHM_KIND_CMA = 2, SHM_KIND_STREAM = 3 };

/* One of the peer's caches as this side reaches it. */
typedef struct shm_entry {
    int64_t id;
    atomic_int refs; /* the table's, each remote cache's, a waiter's */
    int kind;        /* changes from CMA to STREAM once; under lock */
    int users;       /* copies in flight; under lock */
    bool dead;       /* under lock */
    bool warned;
    uint8_t *map; /* our own mapping, unmapped when dead; NULL in the pool */
    size_t map_len;
    uint8_t *base; /* tensor 0, memfd kind */
    uint64_t pitch;
    uint32_t ntensors;
    uint64_t tensor_size;
    uint64_t *addrs; /* the owner's tensor addresses, CMA kind */
    struct shm_entry *next;
} shm_entry;

/* A request of ours waiting for its reply. */
typedef struct shm_wait {
    uint64_t seq;
    bool done;
    uint32_t status;
    llmdd_cache_desc desc;
    uint32_t batch_dim;
    shm_entry *e; /* a reference, for a successful QUERY */
    struct shm_wait *next;
} shm_wait;

/* One of our caches the peer may reach: a reference keeps it alive. */
typedef struct {
    int64_t id;
    llmdd__cache *c;
} shm_lease;

typedef struct {
    llmdd__link *link;
    llmdd__stream *stream;
    char path[64];
    int listen_fd; /* server side, until the client connected */
    int sock;      /* -1 until connected; closed at link_fini */
    int wake_fd;   /* eventfd, readable once the link is down */
    int peer_pidfd;       /* the peer process, from the socket's SO_PEERCRED */
    uint8_t *rbuf, *obuf; /* the reader's, SHM_MSG_MAX each */

    pthread_mutex_t lock;
    pthread_cond_t cond; /* CLOCK_MONOTONIC */
    bool ready;          /* the socket carries requests */
    bool nosock;         /* everything goes over the data plane */
    bool accepted;       /* server: the socket was set up (once) */
    bool down;
    int64_t open_at; /* when the socket was last seen open (owner_left) */
    uint64_t seq;
    shm_wait *waits;
    shm_entry *entries;
    uint8_t *pool; /* the peer's pool memfd, mapped once */
    size_t pool_len;
    dev_t pool_dev;
    ino_t pool_ino;

    pthread_mutex_t expose_lock;
    shm_lease *leases;
    size_t nleases, leases_cap;
} shm_link;

/* A message as shm_sock.c received it. */
typedef struct {
    uint16_t type;
    uint64_t seq;
    llmdd__rbuf body;
    int fd; /* a passed descriptor, or -1 */
} shm_msg;

/* shm.c */
void llmdd__shm_cond_wait(shm_link *sl, int64_t deadline);
int llmdd__shm_poll(shm_link *sl, int fd, short events, int64_t deadline,
                    bool wake);
void llmdd__shm_entry_put(shm_entry *e);
shm_entry *llmdd__shm_entry_find(shm_link *sl, int64_t id);

/* shm_sock.c */
int llmdd__shm_send(shm_link *sl, uint16_t type, uint64_t seq,
                    const uint8_t *payload, size_t len, int pass_fd,
                    int64_t deadline);
int llmdd__shm_recv(shm_link *sl, shm_msg *m);
int llmdd__shm_call(shm_link *sl, uint16_t type, int64_t id, int64_t deadline,
                    shm_wait *w);
void llmdd__shm_cache_removed(llmdd__link *link, const llmdd__cache *cache);
void llmdd__shm_reader(shm_link *sl);
void *llmdd__shm_reader_main(void *arg);

/* shm_xfer.c */
int llmdd__shm_map(shm_link *sl, shm_entry *e, int fd, bool pooled,
                   uint64_t fd_off, uint64_t len);
llmdd_status llmdd__shm_xfer(llmdd__link *link, const llmdd__xfer *x);
/* After a copy through the owner's memory: whether it may have run on
 * memory no longer leased to us (the owner began to end the link). */
bool llmdd__shm_owner_left(shm_link *sl);

#endif
