/*
 * Option values (src/core/options.c) and llmdd_initialize with them: every
 * parser on valid and invalid text, and the rule that a bad value is
 * LLM_PARAM_INVALID and leaves the instance uninitialized
 * (llmdd_option_info, docs/model.md).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/options.h"
#include "harness/harness.h"

static uint16_t
v4_port(const llmdd__sockaddr *a)
{
    return ntohs(((const struct sockaddr_in *)&a->addr)->sin_port);
}

static void
assert_listen_ok(const char *s, int family, uint16_t port)
{
    llmdd__sockaddr a;

    memset(&a, 0, sizeof(a));
    if (llmdd__parse_listen(s, &a) != LLM_SUCCESS)
        fail_msg("\"%s\" rejected", s);
    assert_int_equal(a.addr.ss_family, family);
    if (family == AF_INET) {
        assert_int_equal(a.len, sizeof(struct sockaddr_in));
        assert_int_equal(v4_port(&a), port);
    } else {
        assert_int_equal(a.len, sizeof(struct sockaddr_in6));
        assert_int_equal(
            ntohs(((const struct sockaddr_in6 *)&a.addr)->sin6_port), port);
    }
}

/* Rejected, and the output untouched. */
static void
assert_listen_bad(const char *s)
{
    llmdd__sockaddr a, before;

    memset(&a, 0xa5, sizeof(a));
    before = a;
    if (llmdd__parse_listen(s, &a) != LLM_PARAM_INVALID)
        fail_msg("\"%s\" accepted", s ? s : "(null)");
    assert_memory_equal(&a, &before, sizeof(a));
}

static void
test_parse_listen_valid(void **state)
{
    llmdd__sockaddr a;

    (void)state;
    assert_listen_ok("127.0.0.1:8080", AF_INET, 8080);
    assert_listen_ok("0.0.0.0:1", AF_INET, 1);
    assert_listen_ok("10.1.2.3:65535", AF_INET, 65535);
    assert_listen_ok("[::1]:9000", AF_INET6, 9000);
    assert_listen_ok("[::]:65535", AF_INET6, 65535);
    assert_listen_ok("[::ffff:1.2.3.4]:80", AF_INET6, 80);
    assert_listen_ok("[fe80::1:2:3:4]:7", AF_INET6, 7);

    assert_int_equal(llmdd__parse_listen("192.168.10.20:4242", &a),
                     LLM_SUCCESS);
    const struct sockaddr_in *v4 = (const struct sockaddr_in *)&a.addr;
    assert_int_equal(ntohl(v4->sin_addr.s_addr), 0xc0a80a14u);
}

static void
test_parse_listen_invalid(void **state)
{
    char longhost[LLMDD_IP_LEN + 16];
    char buf[LLMDD_IP_LEN + 32];

    (void)state;
    static const char *const bad[] = {
        /* ports */
        "127.0.0.1:00",
        "127.0.0.1:65536",
        "127.0.0.1:99999",
        "127.0.0.1:4294967297",
        "127.0.0.1:000080",
        "127.0.0.1",
        "127.0.0.1:",
        "127.0.0.1:80a",
        "127.0.0.1:abc",
        "127.0.0.1:0x50",
        "127.0.0.1:+80",
        "127.0.0.1:-80",
        "127.0.0.1:8.0",
        /* spaces */
        " 127.0.0.1:80",
        "127.0.0.1 :80",
        "127.0.0.1: 80",
        "127.0.0.1:80 ",
        "127.0.0.1:80\n",
        /* hosts */
        ":80",
        "[]:80",
        "256.1.1.1:80",
        "1.2.3.256:80",
        "1.2.3:80",
        "1.2.3.4.5:80",
        "localhost:80",
        "example.com:80",
        /* IPv6 forms */
        "::1:80",
        "fe80::1:80",
        "[::1:80",
        "[::1]80",
        "[::1]",
        "[::1]:",
        "::1]:80",
        "[1.2.3.4]:80",
        "[::1]:00",
        "[::1]:65536",
        "[[::1]]:80",
        "[::1]:80:80",
        "[::g]:80",
        "",
        ":",
        "[",
        "]",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_listen_bad(bad[i]);
    assert_listen_bad(NULL);

    /* A host that does not fit LLMDD_IP_LEN, plain and bracketed. */
    memset(longhost, '1', sizeof(longhost) - 1);
    longhost[sizeof(longhost) - 1] = '\0';
    snprintf(buf, sizeof(buf), "%s:80", longhost);
    assert_listen_bad(buf);
    snprintf(buf, sizeof(buf), "[%s]:80", longhost);
    assert_listen_bad(buf);
    /* 0000:...: a valid IPv6 text longer than the buffer. */
    snprintf(buf, sizeof(buf),
             "[0000:0000:0000:0000:0000:0000:0000:"
             "0000:0000:0000:0001]:80");
    assert_listen_bad(buf);
}

static void
test_parse_wait_time(void **state)
{
    uint32_t ms;

    (void)state;
    ms = 0;
    assert_int_equal(llmdd__parse_wait_time("1000", &ms), LLM_SUCCESS);
    assert_int_equal(ms, 1000);
    assert_int_equal(llmdd__parse_wait_time("1", &ms), LLM_SUCCESS);
    assert_int_equal(ms, 1);
    assert_int_equal(llmdd__parse_wait_time("0005", &ms), LLM_SUCCESS);
    assert_int_equal(ms, 5);
    assert_int_equal(llmdd__parse_wait_time("86400000", &ms), LLM_SUCCESS);
    assert_int_equal(ms, LLMDD_MAX_WAIT_MS);

    static const char *const bad[] = {
        "0",          "00",
        "-1",         "1.5",
        " 5",         "5 ",
        "+5",         "",
        "5ms",        "0x10",
        "86400001",   "4294967295",
        "4294967296", "99999999999999999999",
        "1e3",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        ms = 777;
        if (llmdd__parse_wait_time(bad[i], &ms) != LLM_PARAM_INVALID)
            fail_msg("wait time \"%s\" accepted", bad[i]);
        assert_int_equal(ms, 777);
    }
    assert_int_equal(llmdd__parse_wait_time(NULL, &ms), LLM_PARAM_INVALID);
}

static void
assert_pool(const char *s, uint64_t size, uint32_t shift)
{
    llmdd__pool_config c = {0, 0};

    if (llmdd__parse_pool(s, &c) != LLM_SUCCESS)
        fail_msg("pool %s rejected", s);
    assert_int_equal(c.memory_size, size);
    assert_int_equal(c.page_shift, shift);
}

static void
test_parse_pool(void **state)
{
    (void)state;
    assert_pool("{\"memory_size\": 1048576, \"page_shift\": 16}", 1048576, 16);
    assert_pool("{\"page_shift\": 12, \"memory_size\": 4096}", 4096, 12);
    assert_pool("{\"memory_size\": 1073741824, \"page_shift\": 30}", 1073741824,
                30);
    /* page_shift defaults to 16; sizes round up to a whole page. */
    assert_pool("{\"memory_size\": 65536}", 65536, 16);
    assert_pool("{\"memory_size\": 1}", 65536, 16);
    assert_pool("{\"memory_size\": 5000, \"page_shift\": 12}", 8192, 12);
    assert_pool("{\"memory_size\": 8193, \"page_shift\": 12}", 12288, 12);
    assert_pool("{\"memory_size\": 1e6, \"page_shift\": 12}", 1003520, 12);
    /* Unknown members are ignored. */
    assert_pool("{\"memory_size\": 4096, \"page_shift\": 12, \"x\": [1]}", 4096,
                12);

    static const char *const bad[] = {
        "",
        "not json",
        "{",
        "[1, 2]",
        "1048576",
        "\"memory_size\"",
        "null",
        "{}",
        "{\"page_shift\": 16}",
        "{\"memory_size\": 0}",
        "{\"memory_size\": -1}",
        "{\"memory_size\": -4096, \"page_shift\": 12}",
        "{\"memory_size\": 1.5}",
        "{\"memory_size\": \"4096\"}",
        "{\"memory_size\": true}",
        "{\"memory_size\": null}",
        "{\"memory_size\": [4096]}",
        "{\"memory_size\": {}}",
        "{\"memory_size\": 1e30}",
        "{\"memory_size\": 4096, \"page_shift\": 11}",
        "{\"memory_size\": 4096, \"page_shift\": 31}",
        "{\"memory_size\": 4096, \"page_shift\": 0}",
        "{\"memory_size\": 4096, \"page_shift\": -16}",
        "{\"memory_size\": 4096, \"page_shift\": 12.5}",
        "{\"memory_size\": 4096, \"page_shift\": \"12\"}",
        "{\"memory_size\": 4096, \"page_shift\": null}",
        "{\"Memory_Size\": 4096}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        llmdd__pool_config c = {123, 45};
        if (llmdd__parse_pool(bad[i], &c) != LLM_PARAM_INVALID)
            fail_msg("pool %s accepted", bad[i]);
        assert_int_equal(c.memory_size, 123);
        assert_int_equal(c.page_shift, 45);
    }
    llmdd__pool_config c;
    assert_int_equal(llmdd__parse_pool(NULL, &c), LLM_PARAM_INVALID);
}

static llmdd_ip_info
ipi(const char *ip, uint16_t port)
{
    llmdd_ip_info i;

    memset(&i, 0, sizeof(i));
    snprintf(i.ip, sizeof(i.ip), "%s", ip);
    i.port = port;
    return i;
}

static void
test_parse_ip_info(void **state)
{
    llmdd__sockaddr a;
    llmdd_ip_info i;

    (void)state;
    i = ipi("127.0.0.1", 80);
    assert_int_equal(llmdd__parse_ip_info(&i, &a), LLM_SUCCESS);
    assert_int_equal(a.addr.ss_family, AF_INET);
    assert_int_equal(v4_port(&a), 80);
    i = ipi("::1", 65535);
    assert_int_equal(llmdd__parse_ip_info(&i, &a), LLM_SUCCESS);
    assert_int_equal(a.addr.ss_family, AF_INET6);

    static const char *const bad[] = {
        "",           "localhost", "1.2.3.256", "[::1]", "::1:",
        "1.2.3.4:80", " 1.2.3.4",  "1.2.3.4 ",  "::g",
    };
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
        i = ipi(bad[k], 80);
        if (llmdd__parse_ip_info(&i, &a) != LLM_PARAM_INVALID)
            fail_msg("ip \"%s\" accepted", bad[k]);
    }
    i = ipi("127.0.0.1", 0);
    assert_int_equal(llmdd__parse_ip_info(&i, &a), LLM_PARAM_INVALID);
    /* Not NUL-terminated within LLMDD_IP_LEN. */
    memset(i.ip, '1', sizeof(i.ip));
    i.port = 80;
    assert_int_equal(llmdd__parse_ip_info(&i, &a), LLM_PARAM_INVALID);
    assert_int_equal(llmdd__parse_ip_info(NULL, &a), LLM_PARAM_INVALID);
}

/* A port nobody listens on right now: bound, read, released. */
static uint16_t
unused_port(void)
{
    struct sockaddr_in sa = {.sin_family = AF_INET};
    socklen_t len = sizeof(sa);
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    assert_true(fd >= 0);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
    close(fd);
    return ntohs(sa.sin_port);
}

/* Whether a TCP connect to 127.0.0.1:port is accepted by the kernel. */
static bool
port_open(uint16_t port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    assert_true(fd >= 0);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    close(fd);
    return ok;
}

/* Not initialized: every call but the lifecycle ones says LLM_FAILED. */
static void
assert_uninitialized(llmdd *dd)
{
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c;

    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_FAILED);
    assert_int_equal(llmdd_deallocate_cache(dd, 1), LLM_FAILED);
}

/* initialize with opts must fail with want and leave dd uninitialized. */
static void
assert_init_fails(const llmdd_option *opts, size_t n, llmdd_status want)
{
    llmdd *dd;

    assert_int_equal(llmdd_create(2, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    llmdd_status st = llmdd_initialize(dd, opts, n);
    if (st != want)
        fail_msg("initialize with %s=%s: %s, want %s",
                 n > 0 && opts[n - 1].key ? opts[n - 1].key : "(null)",
                 n > 0 && opts[n - 1].value ? opts[n - 1].value : "(null)",
                 llmdd_status_str(st), llmdd_status_str(want));
    assert_uninitialized(dd);
    /* And it can still be initialized properly. */
    assert_int_equal(llmdd_initialize(dd, NULL, 0), LLM_SUCCESS);
    llmdd_destroy(dd);
}

static void
test_initialize_bad_options(void **state)
{
    char long_token[LLMDD_AUTH_TOKEN_MAX + 2];

    (void)state;
    memset(long_token, 't', sizeof(long_token) - 1);
    long_token[sizeof(long_token) - 1] = '\0';
    static const llmdd_option bad[] = {
        {"llm.ListenIpInfo", "127.0.0.1"},
        {"llm.ListenIpInfo", "127.0.0.1:00"},
        {"llm.ListenIpInfo", "localhost:5000"},
        {"llm.ListenIpInfo", ""},
        {"llm.DeviceId", "-1"},
        {"llm.DeviceId", "abc"},
        {"llm.DeviceId", ""},
        {"llm.DeviceId", "2147483648"},
        {"llm.DeviceId", "4294967296"},
        {"llm.SyncKvCacheWaitTime", "0"},
        {"llm.SyncKvCacheWaitTime", "-1"},
        {"llm.SyncKvCacheWaitTime", "1.5"},
        {"llm.SyncKvCacheWaitTime", ""},
        {"llm.HostMemPoolConfig", "{}"},
        {"llm.HostMemPoolConfig", "{\"memory_size\": 0}"},
        {"llm.HostMemPoolConfig", "x"},
        {"llm.MemPoolConfig", "{\"memory_size\": -1}"},
        {"llm.MemPoolConfig", ""},
        {"llm.Transport", "foo"},
        {"llm.Transport", ""},
        {"llm.Transport", "tcpx"},
        {"llm.Transport", "a-name-much-too-long-for-a-transport"},
        {"llm.AuthToken", ""},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_init_fails(&bad[i], 1, LLM_PARAM_INVALID);

    llmdd_option tok = {"llm.AuthToken", long_token};
    assert_init_fails(&tok, 1, LLM_PARAM_INVALID);

    /* A NULL key or value, and a NULL array with a count. */
    llmdd_option nk = {NULL, "1000"}, nv = {"llm.SyncKvCacheWaitTime", NULL};
    assert_init_fails(&nk, 1, LLM_PARAM_INVALID);
    assert_init_fails(&nv, 1, LLM_PARAM_INVALID);
    assert_init_fails(NULL, 1, LLM_PARAM_INVALID);

    /* A bad value after good ones, including a listen address. */
    llmdd_option mixed[] = {{"llm.SyncKvCacheWaitTime", "500"},
                            {"llm.Transport", "tcp"},
                            {"llm.SyncKvCacheWaitTime", "0"}};
    assert_init_fails(mixed, 3, LLM_PARAM_INVALID);
}

static void
test_failed_initialize_does_not_listen(void **state)
{
    char addr[32];
    uint16_t port = unused_port();
    llmdd *dd;

    (void)state;
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    llmdd_option opts[] = {{"llm.ListenIpInfo", addr},
                           {"llm.HostMemPoolConfig", "{\"memory_size\": 0}"}};
    assert_int_equal(llmdd_create(2, LLMDD_ROLE_PROMPT, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, opts, 2), LLM_PARAM_INVALID);
    assert_false(port_open(port));
    assert_uninitialized(dd);
    /* With the bad option gone it listens there. */
    assert_int_equal(llmdd_initialize(dd, opts, 1), LLM_SUCCESS);
    assert_true(port_open(port));
    llmdd_destroy(dd);
    assert_false(port_open(port));
}

static void
test_initialize_valid_options(void **state)
{
    llmdd *dd;

    (void)state;
    llmdd_option opts[] = {
        {"llm.SyncKvCacheWaitTime", "2500"},
        {"llm.DeviceId", "0"},
        {"llm.HostMemPoolConfig",
         "{\"memory_size\": 1048576, \"page_shift\": 12}"},
        {"llm.MemPoolConfig", "{\"memory_size\": 1048576}"},
        {"llm.Transport", "auto"},
        {"llm.AuthToken", "secret"},
        {"llm.SomethingNew", "whatever"}, /* unknown keys are ignored */
        {"", ""},
    };
    assert_int_equal(llmdd_create(2, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, opts, sizeof(opts) / sizeof(*opts)),
                     LLM_SUCCESS);
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c;
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    llmdd_destroy(dd);

    /* No options at all, and an empty array. */
    assert_int_equal(llmdd_create(2, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, opts, 0), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(llmdd_create(2, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, NULL, 0), LLM_SUCCESS);
    llmdd_destroy(dd);
}

static bool
transport_built(const char *name)
{
    const char *list = llmdd_transport_list();
    size_t n = strlen(name);

    for (const char *p = list; p != NULL && *p != '\0';) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0)
            return true;
        p = comma ? comma + 1 : NULL;
    }
    return false;
}

static void
test_transport_values(void **state)
{
    static const char *const names[] = {"auto", "loop", "tcp", "shm", "ucx"};

    (void)state;
    assert_true(transport_built("loop"));
    assert_true(transport_built("tcp"));
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        llmdd_option o = {"llm.Transport", names[i]};
        bool built = strcmp(names[i], "auto") == 0 || transport_built(names[i]);
        llmdd *dd;

        if (!built) {
            /* A known name that is not built in. */
            assert_init_fails(&o, 1, LLM_FEATURE_NOT_ENABLED);
            continue;
        }
        assert_int_equal(llmdd_create(2, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
        if (llmdd_initialize(dd, &o, 1) != LLM_SUCCESS)
            fail_msg("llm.Transport=%s rejected", names[i]);
        llmdd_destroy(dd);
    }
}

static void
test_listen_port_zero(void **state)
{
    llmdd_option o = {"llm.ListenIpInfo", "127.0.0.1:0"};
    llmdd_ip_info at;
    llmdd *dd;

    (void)state;
    assert_int_equal(llmdd_create(2, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_listen_address(dd, &at), LLM_FAILED);
    assert_int_equal(llmdd_initialize(dd, &o, 1), LLM_SUCCESS);
    assert_int_equal(llmdd_listen_address(dd, NULL), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_listen_address(dd, &at), LLM_SUCCESS);
    assert_string_equal(at.ip, "127.0.0.1");
    assert_int_not_equal(at.port, 0);
    /* Something really listens there. */
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons(at.port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(connect(s, (struct sockaddr *)&a, sizeof(a)), 0);
    close(s);
    llmdd_finalize(dd);
    assert_int_equal(llmdd_listen_address(dd, &at), LLM_FAILED);
    llmdd_destroy(dd);
}

static void
test_max_links_values(void **state)
{
    static const char *const bad[] = {"0", "65536", "-1", "", "1k", "Auto"};
    static const char *const good[] = {"1", "65535", "auto", "300"};

    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        llmdd_option o = {"llm.MaxLinks", bad[i]};
        assert_init_fails(&o, 1, LLM_PARAM_INVALID);
    }
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        llmdd_option o = {"llm.MaxLinks", good[i]};
        llmdd *dd;
        assert_int_equal(llmdd_create(2, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
        if (llmdd_initialize(dd, &o, 1) != LLM_SUCCESS)
            fail_msg("llm.MaxLinks=%s rejected", good[i]);
        llmdd_destroy(dd);
    }
}

/*
 * llm.MaxLinks=auto counts the descriptors a link holds with the lanes
 * llm.TcpLanes gives it (2N + 4, at least 8), whichever key comes first;
 * a number stays a number.
 */
static void
test_max_links_follow_lanes(void **state)
{
    struct rlimit old, rl;

    (void)state;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    rl = old;
    rl.rlim_cur = 1024 < old.rlim_max ? 1024 : old.rlim_max;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &rl), 0);
    if (rl.rlim_cur == 1024) {
        assert_int_equal(llmdd__max_links_auto(1), (1024 - 64) / 8);
        assert_int_equal(llmdd__max_links_auto(0), (1024 - 64) / 12);
        assert_int_equal(llmdd__max_links_auto(16), (1024 - 64) / 36);
    }
    llmdd__options o;
    llmdd__options_init(&o);
    assert_int_equal(o.max_links, llmdd__max_links_auto(0));
    llmdd_option lanes16[] = {{"llm.MaxLinks", "auto"}, {"llm.TcpLanes", "16"}};
    assert_int_equal(llmdd__options_apply(&o, lanes16, 2), LLM_SUCCESS);
    assert_int_equal(o.max_links, llmdd__max_links_auto(16));
    llmdd_option lanes1 = {"llm.TcpLanes", "1"};
    assert_int_equal(llmdd__options_apply(&o, &lanes1, 1), LLM_SUCCESS);
    assert_int_equal(o.max_links, llmdd__max_links_auto(1));
    llmdd_option fixed[] = {{"llm.MaxLinks", "300"}, {"llm.TcpLanes", "16"}};
    assert_int_equal(llmdd__options_apply(&o, fixed, 2), LLM_SUCCESS);
    assert_int_equal(o.max_links, 300);
    llmdd__options_fini(&o);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
}

/*
 * The table of keys (llmdd_option_info): every key documented once, with
 * its words, and its default a value llmdd_initialize takes; the defaults
 * are what an instance uses when the key is not given.
 */
static void
test_option_info(void **state)
{
    static const char *const keys[] = {
        LLMDD_OPT_LISTEN,     LLMDD_OPT_DEVICE_ID,   LLMDD_OPT_WAIT_TIME,
        LLMDD_OPT_HOST_POOL,  LLMDD_OPT_DEVICE_POOL, LLMDD_OPT_TRANSPORT,
        LLMDD_OPT_AUTH_TOKEN, LLMDD_OPT_MAX_LINKS,   LLMDD_OPT_TCP_LANES,
    };
    const llmdd_option_doc *d;
    size_t n = 0, with_default = 0;

    (void)state;
    for (; (d = llmdd_option_info(n)) != NULL; n++) {
        assert_non_null(d->key);
        assert_true(strncmp(d->key, "llm.", 4) == 0);
        assert_true(d->values != NULL && d->values[0] != '\0');
        assert_true(d->default_text != NULL && d->default_text[0] != '\0');
        assert_true(d->meaning != NULL && d->meaning[0] != '\0');
        for (size_t j = 0; j < n; j++)
            assert_string_not_equal(llmdd_option_info(j)->key, d->key);
        if (d->default_value == NULL)
            continue;
        with_default++;
        assert_string_equal(d->default_value, d->default_text);
        llmdd_option o = {d->key, d->default_value};
        llmdd *dd;
        assert_int_equal(llmdd_create(2, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
        if (llmdd_initialize(dd, &o, 1) != LLM_SUCCESS)
            fail_msg("%s=%s (its default) rejected", d->key, d->default_value);
        llmdd_destroy(dd);
    }
    assert_null(llmdd_option_info(n + 1));
    assert_null(llmdd_option_info(SIZE_MAX));
    assert_true(with_default >= 4);
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        size_t j = 0;
        while (j < n && strcmp(llmdd_option_info(j)->key, keys[i]) != 0)
            j++;
        if (j == n)
            fail_msg("%s is not documented", keys[i]);
    }

    /* Applying every default to fresh options changes nothing. */
    llmdd__options a, b;
    llmdd__options_init(&a);
    llmdd__options_init(&b);
    assert_int_equal(a.wait_ms, 1000);
    assert_string_equal(a.transport, "auto");
    assert_int_equal(a.max_links, llmdd__max_links_auto(0));
    assert_int_equal(a.tcp_lanes, 0);
    for (size_t i = 0; i < n; i++) {
        d = llmdd_option_info(i);
        llmdd_option o = {d->key, d->default_value ? d->default_value : "x"};
        if (d->default_value == NULL && strcmp(d->values, "any") != 0)
            continue; /* unset by default: no value says so */
        assert_int_equal(llmdd__options_apply(&b, &o, 1), LLM_SUCCESS);
    }
    assert_int_equal(b.listen, a.listen);
    assert_int_equal(b.device_id, a.device_id);
    assert_int_equal(b.wait_ms, a.wait_ms);
    assert_int_equal(b.host_pool, a.host_pool);
    assert_int_equal(b.device_pool, a.device_pool);
    assert_string_equal(b.transport, a.transport);
    assert_null(b.auth_token);
    assert_int_equal(b.max_links, a.max_links);
    assert_int_equal(b.tcp_lanes, a.tcp_lanes);
    llmdd__options_fini(&a);
    llmdd__options_fini(&b);
}

/*
 * llm.listenIpInfo, the reference's older spelling (connectors written for
 * its V0 API pass it), listens as llm.ListenIpInfo does: checked the same,
 * and the key given last wins.
 */
static void
test_listen_alias(void **state)
{
    char addr[32];
    uint16_t port = unused_port();
    llmdd__options o;
    llmdd *dd;

    (void)state;
    llmdd__options_init(&o);
    llmdd_option two[] = {{"llm.ListenIpInfo", "127.0.0.1:1"},
                          {"llm.listenIpInfo", "127.0.0.1:2"}};
    assert_int_equal(llmdd__options_apply(&o, two, 2), LLM_SUCCESS);
    assert_true(o.listen);
    assert_int_equal(v4_port(&o.listen_addr), 2);
    llmdd__options_fini(&o);
    llmdd_option bad = {"llm.listenIpInfo", "127.0.0.1"};
    assert_init_fails(&bad, 1, LLM_PARAM_INVALID);

    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    llmdd_option kv = {"llm.listenIpInfo", addr};
    assert_int_equal(llmdd_create(2, LLMDD_ROLE_PROMPT, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, &kv, 1), LLM_SUCCESS);
    assert_true(port_open(port));
    llmdd_destroy(dd);
}

static void
test_tcp_lanes_values(void **state)
{
    static const char *const bad[] = {"0", "17", "-1", "", "2x", "Auto"};
    static const struct {
        const char *v;
        int lanes;
    } good[] = {{"auto", 0}, {"1", 1}, {"16", 16}, {"4", 4}};
    llmdd__options o;

    (void)state;
    llmdd__options_init(&o);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        llmdd_option kv = {LLMDD_OPT_TCP_LANES, bad[i]};
        if (llmdd__options_apply(&o, &kv, 1) != LLM_PARAM_INVALID)
            fail_msg("llm.TcpLanes=%s accepted", bad[i]);
        assert_int_equal(o.tcp_lanes, 0);
        assert_init_fails(&kv, 1, LLM_PARAM_INVALID);
    }
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        llmdd_option kv = {LLMDD_OPT_TCP_LANES, good[i].v};
        assert_int_equal(llmdd__options_apply(&o, &kv, 1), LLM_SUCCESS);
        assert_int_equal(o.tcp_lanes, good[i].lanes);
    }
    llmdd__options_fini(&o);
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_listen_valid),
        cmocka_unit_test(test_parse_listen_invalid),
        cmocka_unit_test(test_parse_wait_time),
        cmocka_unit_test(test_parse_pool),
        cmocka_unit_test(test_parse_ip_info),
        cmocka_unit_test(test_initialize_bad_options),
        cmocka_unit_test(test_failed_initialize_does_not_listen),
        cmocka_unit_test(test_initialize_valid_options),
        cmocka_unit_test(test_transport_values),
        cmocka_unit_test(test_max_links_values),
        cmocka_unit_test(test_max_links_follow_lanes),
        cmocka_unit_test(test_listen_port_zero),
        cmocka_unit_test(test_option_info),
        cmocka_unit_test(test_tcp_lanes_values),
        cmocka_unit_test(test_listen_alias),
    };
    return cmocka_run_group_tests_name("options", tests, NULL, NULL);
}
