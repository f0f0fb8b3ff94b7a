/*
 * A small HTTP/1.1 server that keeps connections open, for bench.e2e's keep-alive endpoint load.
 *
 * busybox httpd closes every connection, so it cannot show what the endpoint route gains from
 * keeping upstream connections; an inference server does keep them. This one answers every GET
 * with the same page (Content-Length framed) and keeps the connection until the client closes
 * it, asks `Connection: close`, or speaks HTTP/1.0 without `Connection: keep-alive`. One thread,
 * epoll, non-blocking sockets: fast enough that the anchor (a client straight to it) measures the
 * client and the network, not this server.
 *
 * Built static (`gcc -O2 -static`) so it runs in the busybox image with no libc of its own.
 * Usage: keepalive PORT PAGE
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_EVENTS 64
#define HEAD_LIMIT 16384

struct conn {
    int fd;
    size_t have;              /* request bytes buffered in `in` */
    char in[HEAD_LIMIT];
    char *out;                /* response bytes not yet written */
    size_t out_len, out_sent;
    int close_after;          /* close once `out` is written */
};

/* The answers to a good request, by [HEAD?][HTTP/1.0 kept open?]: an HTTP/1.0 client is told
 * that its connection stays open (it would wait for the close otherwise). */
static char *ok_response[2][2];
static size_t ok_len[2][2];
static const char bad_response[] =
    "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
static const char method_response[] =
    "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET, HEAD\r\nContent-Length: 0\r\n"
    "Connection: close\r\n\r\n";

static void drop(int epoll_fd, struct conn *c) {
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c);
}

/* Whether the request head (NUL-terminated, lines split by CRLF) has header `name` whose value
 * contains `token`, case-insensitively. */
static int header_has(const char *head, const char *name, const char *token) {
    size_t name_len = strlen(name);
    for (const char *line = strstr(head, "\r\n"); line; line = strstr(line, "\r\n")) {
        line += 2;
        if (strncasecmp(line, name, name_len) == 0 && line[name_len] == ':') {
            const char *end = strstr(line, "\r\n");
            size_t len = end ? (size_t)(end - line) : strlen(line);
            char value[256];
            if (len >= sizeof value) len = sizeof value - 1;
            memcpy(value, line, len);
            value[len] = 0;
            if (strcasestr(value + name_len + 1, token)) return 1;
        }
    }
    return 0;
}

/* Writes what is left of the answer; -1 when the connection broke. */
static int flush(struct conn *c) {
    while (c->out_sent < c->out_len) {
        ssize_t n = write(c->fd, c->out + c->out_sent, c->out_len - c->out_sent);
        if (n < 0) return errno == EAGAIN ? 0 : -1;
        c->out_sent += (size_t)n;
    }
    return 0;
}

/* Takes the first complete request head in the buffer, if any, and makes its answer the one to
 * write. Returns 1 when it did, 0 when no whole head is buffered yet, -1 when the head is too
 * long to be one. */
static int take_request(struct conn *c) {
    c->in[c->have] = 0;
    char *end = strstr(c->in, "\r\n\r\n");
    if (!end) return c->have >= HEAD_LIMIT - 1 ? -1 : 0;
    *end = 0;
    size_t used = (size_t)(end + 4 - c->in);
    char *line_end = strstr(c->in, "\r\n");
    if (!line_end) line_end = end;
    int http10 = line_end - c->in >= 9 && strncmp(line_end - 9, " HTTP/1.0", 9) == 0;
    int head = strncmp(c->in, "HEAD ", 5) == 0;
    if (header_has(c->in, "Content-Length", "") || header_has(c->in, "Transfer-Encoding", "")) {
        /* A GET never carries a body here; a request that has one is not understood. */
        c->out = (char *)bad_response;
        c->out_len = sizeof bad_response - 1;
        c->close_after = 1;
    } else if (strncmp(c->in, "GET ", 4) != 0 && !head) {
        c->out = (char *)method_response;
        c->out_len = sizeof method_response - 1;
        c->close_after = 1;
    } else {
        c->close_after = header_has(c->in, "Connection", "close")
            || (http10 && !header_has(c->in, "Connection", "keep-alive"));
        int kept10 = http10 && !c->close_after;
        c->out = ok_response[head][kept10];
        c->out_len = ok_len[head][kept10];
    }
    c->out_sent = 0;
    memmove(c->in, c->in + used, c->have - used);
    c->have -= used;
    return 1;
}

/* Moves a connection on as far as it can without blocking: writes the answer in flight, answers
 * the next buffered request, reads more. Returns -1 when the connection is done. */
static int serve(struct conn *c) {
    for (;;) {
        if (flush(c) < 0) return -1;
        if (c->out_sent < c->out_len) return 0; /* EPOLLOUT comes back here */
        if (c->close_after) return -1;
        int taken = take_request(c);
        if (taken < 0) return -1;
        if (taken > 0) continue;
        ssize_t n = read(c->fd, c->in + c->have, HEAD_LIMIT - 1 - c->have);
        if (n == 0 || (n < 0 && errno != EAGAIN)) return -1;
        if (n < 0) return 0; /* EPOLLIN comes back here */
        c->have += (size_t)n;
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PORT PAGE\n", argv[0]);
        return 2;
    }
    const char *page = argv[2];
    size_t page_len = strlen(page);
    for (int head = 0; head < 2; head++) {
        for (int kept10 = 0; kept10 < 2; kept10++) {
            char *response = malloc(page_len + 160);
            int n = sprintf(response,
                "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %zu\r\n%s\r\n",
                page_len, kept10 ? "Connection: keep-alive\r\n" : "");
            if (!head) memcpy(response + n, page, page_len);
            ok_response[head][kept10] = response;
            ok_len[head][kept10] = (size_t)n + (head ? 0 : page_len);
        }
    }

    int listener = socket(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int family6 = listener >= 0;
    if (!family6) listener = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1, zero = 0;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int bound;
    if (family6) {
        setsockopt(listener, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        struct sockaddr_in6 address = {.sin6_family = AF_INET6, .sin6_addr = in6addr_any,
                                       .sin6_port = htons((unsigned short)atoi(argv[1]))};
        bound = bind(listener, (struct sockaddr *)&address, sizeof address);
    } else {
        struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = INADDR_ANY,
                                      .sin_port = htons((unsigned short)atoi(argv[1]))};
        bound = bind(listener, (struct sockaddr *)&address, sizeof address);
    }
    if (bound < 0 || listen(listener, 1024) < 0) {
        perror("keepalive: bind/listen");
        return 1;
    }
    int epoll_fd = epoll_create1(0);
    struct epoll_event event = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listener, &event);
    struct epoll_event events[MAX_EVENTS];
    for (;;) {
        int ready = epoll_wait(epoll_fd, events, MAX_EVENTS, -1);
        if (ready < 0 && errno != EINTR) {
            perror("keepalive: epoll_wait");
            return 1;
        }
        for (int i = 0; i < ready; i++) {
            struct conn *c = events[i].data.ptr;
            if (c == NULL) {
                int fd;
                while ((fd = accept4(listener, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    struct conn *fresh = calloc(1, sizeof *fresh);
                    fresh->fd = fd;
                    struct epoll_event watch = {.events = EPOLLIN | EPOLLOUT | EPOLLET,
                                                .data.ptr = fresh};
                    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &watch);
                }
                continue;
            }
            int gone = serve(c) < 0;
            if (gone) drop(epoll_fd, c);
        }
    }
}
