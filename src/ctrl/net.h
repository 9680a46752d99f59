/*
 * Socket helpers shared by the control plane and the socket transports:
 * framed messages with deadlines, connect with a deadline, socket options.
 * Thread-safe; each function works on the fd it is given.
 */
#ifndef LLMDD_CTRL_NET_H
#define LLMDD_CTRL_NET_H

#include "core/internal.h"
#include "ctrl/wire.h"

/* Sends a frame header and payload in one sendmsg; 0 on success. */
int llmdd__send_msg(llmdd *dd, int fd, uint16_t type, const void *payload,
                    size_t len, int64_t deadline_ms);
/*
 * Receives one frame whose payload is at most `cap` bytes into buf.
 * Returns 0 and fills *type and *len, or -1 on a bad header, an oversized
 * payload, EOF, timeout or stop. *timed_out tells a timeout apart.
 */
int llmdd__recv_msg(llmdd *dd, int fd, uint16_t *type, uint8_t *buf,
                    size_t cap, size_t *len, int64_t deadline_ms,
                    bool *timed_out);

/*
 * Connects a non-blocking TCP socket to addr by the deadline. Returns the fd,
 * or -1 with *status set: LLM_LINK_FAILED (refused, unreachable) or
 * LLM_TIMEOUT.
 */
int llmdd__connect(llmdd *dd, const llmdd__sockaddr *addr,
                   int64_t deadline_ms, llmdd_status *status);
/* The same from a local address `from` (NULL or AF_UNSPEC: any); a bind
 * that fails (not an address of this host) is LLM_LINK_FAILED. */
int llmdd__connect_from(llmdd *dd, const llmdd__sockaddr *addr,
                        const llmdd__sockaddr *from, int64_t deadline_ms,
                        llmdd_status *status);

/* TCP_NODELAY and, for control sockets, keepalive so a dead host shows. */
void llmdd__sock_tune(int fd, bool keepalive);

/*
 * Opens a data connection for `link` to the peer's listener (client side):
 * a HELLO of kind CONN_DATA with the link token and the transport's flags,
 * answered by DATA_REPLY. The listener hands the connection to the link's
 * transport (ops->accept_conn). Returns the fd or -1.
 */
int llmdd__data_connect(llmdd__link *link, uint32_t flags,
                        int64_t deadline);

#endif
