/* Keep a local Ray on this machine: every listening socket of the processes it starts binds loopback.
 *
 * Why: Ray 2.60's gcs_server and raylet bind their gRPC servers to the wildcard address whatever
 * --node-ip-address says, and its agents bind 0.0.0.0 or the host's address. `rasd serve` starts Ray with
 * this library in LD_PRELOAD (rasd/serve/loopback.py builds it), and bind() here rewrites any IPv4 address
 * but 127.0.0.0/8 to 127.0.0.1 and any IPv6 address but ::1 to ::1 (or, for a dual-stack socket, to
 * ::ffff:127.0.0.1, so IPv4 clients of 127.0.0.1 still connect). Only bind() is touched: outgoing
 * connections are unchanged. RASD_LOOPBACK_KEEP_PORT names one port left alone (the HTTP service when the
 * user asked for --host 0.0.0.0).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int kept_port(unsigned short port_be) {
    const char *keep = getenv("RASD_LOOPBACK_KEEP_PORT");
    return keep != NULL && *keep != '\0' && atoi(keep) == (int)ntohs(port_be);
}

static int dual_stack(int fd) {
    int v6only = 1;
    socklen_t len = sizeof v6only;
    return getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &len) == 0 && v6only == 0;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind = NULL;
    if (real_bind == NULL)
        real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr != NULL && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        if ((ntohl(in4.sin_addr.s_addr) >> 24) != 127 && !kept_port(in4.sin_port)) {
            in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&in4, sizeof in4);
        }
    } else if (addr != NULL && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        int v4_loopback = IN6_IS_ADDR_V4MAPPED(&in6.sin6_addr) && in6.sin6_addr.s6_addr[12] == 127;
        if (!IN6_IS_ADDR_LOOPBACK(&in6.sin6_addr) && !v4_loopback && !kept_port(in6.sin6_port)) {
            if (dual_stack(fd)) {
                static const unsigned char mapped[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1};
                memcpy(&in6.sin6_addr, mapped, sizeof mapped);
            } else {
                in6.sin6_addr = in6addr_loopback;
            }
            in6.sin6_scope_id = 0;
            return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
    }
    return real_bind(fd, addr, len);
}
